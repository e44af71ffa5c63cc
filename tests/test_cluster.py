"""cluster/ against the schemas of the tools that read it, and the docs' commands against the repository.

- cluster/aws.yaml: Ray's cluster-launcher validation (what `ray up` runs before it calls AWS) and the
  EC2 RunInstances request model that ships with botocore (field names, instance types).
- cluster/serve.yaml and the RayService's serveConfigV2: Serve's ServeDeploySchema, and equal.
- cluster/kuberay/: the fields KubeRay's CRDs define (encoded below, checked against the v1 CRDs of
  KubeRay v1.5.1 and master), images, Ray version, resources.
- cluster/deepspeed/*.json: DeepSpeed's own config parser; cluster/train-gpu.yaml: the pipeline's config.
- README.md and docs/*.md: every `python ...` command names a script or module that exists and answers
  `--help` (all of them in one interpreter: HELP_RUNNER), every repository path and `serve run`
  import path they name exists, every `make` target is in the Makefile.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml

ROOT = Path(__file__).resolve().parents[1]
IMAGE = f"rayproject/ray:{ray.__version__}-py311-gpu"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Serve's schema warns about pydantic

def load(path: str):
    return yaml.safe_load((ROOT / path).read_text())


def require(path: str) -> Path:
    """The repository file at `path`; a missing one fails the test."""
    if not (ROOT / path).exists():
        pytest.fail(f"{path} does not exist")
    return ROOT / path


def makefile_pins() -> dict[str, str]:
    """The `name==version` pins the Makefile installs (torch, the embedded target, MT-Bench, DFlash)."""
    lines = re.findall(r"pip install ([^\n]*)", (ROOT / "Makefile").read_text())
    return dict(pin for line in lines for pin in re.findall(r"([\w-]+)==([\w.]+)", line))


# -- cluster/aws.yaml ---------------------------------------------------------------------------------


def test_aws_config_passes_ray_cluster_launcher_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(load("cluster/aws.yaml"))  # merged with Ray's AWS defaults, as `ray up` does
    validate_config(config)  # ray-schema.json, then Ray's own consistency checks
    assert config["provider"]["type"] == "aws"
    assert config["docker"]["image"] == IMAGE


def test_aws_node_configs_are_valid_ec2_run_instances_requests():
    import botocore.session
    from botocore.validate import validate_parameters

    shape = botocore.session.get_session().get_service_model("ec2").operation_model("RunInstances").input_shape

    def enum_errors(value, shape, where):
        if shape.type_name == "structure":
            return [e for key, v in value.items() for e in enum_errors(v, shape.members[key], f"{where}.{key}")]
        if shape.type_name == "list":
            return [e for i, v in enumerate(value) for e in enum_errors(v, shape.member, f"{where}[{i}]")]
        allowed = getattr(shape, "enum", None)
        return [f"{where} = {value!r}"] if allowed and value not in allowed else []

    for name, node_type in load("cluster/aws.yaml")["available_node_types"].items():
        validate_parameters(dict(node_type["node_config"], MinCount=1, MaxCount=1), shape)  # field names, types
        assert enum_errors(node_type["node_config"], shape, name) == []  # instance types, spot, volume types


def test_aws_groups_image_storage_and_setup():
    config = load("cluster/aws.yaml")
    types = config["available_node_types"]
    head, workers = types[config["head_node_type"]], {k: v for k, v in types.items() if k != config["head_node_type"]}
    assert {"features", "features_spot", "trainers", "serving"} <= set(workers)
    assert head["node_config"]["InstanceType"] == "m7i.2xlarge"  # a CPU head
    assert types["features_spot"]["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
    for name, node_type in workers.items():
        assert 0 <= node_type["min_workers"] <= node_type["max_workers"], name
        assert node_type["node_config"]["IamInstanceProfile"]["Arn"].startswith("arn:aws:iam::"), name  # S3 access
    for name, node_type in types.items():
        (root,) = node_type["node_config"]["BlockDeviceMappings"]
        assert root["Ebs"]["VolumeSize"] >= 200, name  # the image, torch and model weights

    setup = " ; ".join(config["setup_commands"])
    for package, version in makefile_pins().items():  # the same pins as the quick start's environment
        assert f"{package}=={version}" in setup
    assert "pip install --quiet -e ~/domino" in setup and config["file_mounts"]["~/domino"] == "."
    for command in (config["head_start_ray_commands"][-1], config["worker_start_ray_commands"][-1]):
        assert "export RAY_AUTH_MODE=token" in command
    assert "~/.ray/auth_token" in config["file_mounts"]


# vCPUs and GPUs of the instance types above (AWS instance type pages); Ray detects the same on the node.
INSTANCE_SHAPES = {"m7i.2xlarge": (8, 0), "g6e.xlarge": (4, 1), "g6e.2xlarge": (8, 1), "p5.48xlarge": (192, 8)}


def fits(request: dict, node: dict) -> bool:
    return all(node.get(key, 0) >= amount for key, amount in request.items())


def requests_from_training_config() -> dict[str, dict]:
    train = load("cluster/train-gpu.yaml")
    return {"trainer": {"CPU": train["trainer_cpus"], "GPU": 1},
            "feature actor": {"CPU": train["feature_cpus"], "GPU": train["feature_gpus"]}}


def test_aws_groups_are_told_apart_by_what_work_asks_for():
    """Trainers fit only the H100 group, feature actors never a serving node, replicas only the serving group."""
    nodes = {}
    for name, node_type in load("cluster/aws.yaml")["available_node_types"].items():
        instance = node_type["node_config"]["InstanceType"]
        assert instance in INSTANCE_SHAPES, f"add {instance}'s vCPUs and GPUs to INSTANCE_SHAPES"
        cpus, gpus = INSTANCE_SHAPES[instance]
        nodes[name] = {"CPU": cpus, "GPU": gpus, **node_type["resources"]}
    requests = requests_from_training_config() | {"replica": {"GPU": 1, "serve_node": 1}}
    placed = {work: {name for name, node in nodes.items() if fits(request, node)} for work, request in requests.items()}
    assert placed["trainer"] == {"trainers"}
    assert {"features", "features_spot"} <= placed["feature actor"] and "serving" not in placed["feature actor"]
    assert placed["replica"] == {"serving"}
    train = load("cluster/train-gpu.yaml")
    trainer_nodes = math.ceil(train["num_workers"] / nodes["trainers"]["GPU"])
    assert trainer_nodes <= load("cluster/aws.yaml")["available_node_types"]["trainers"]["max_workers"]


def test_training_config_is_a_valid_pipeline_config():
    require("pipelines/training/config.py")
    from pipelines.training.config import build_config

    cfg = build_config(load("cluster/train-gpu.yaml"))
    assert cfg.use_gpu and cfg.storage_path.startswith("s3://")
    require(cfg.deepspeed_config)
    long_cpu = build_config(load("cluster/train-cpu-long.yaml"))
    assert not long_cpu.use_gpu and long_cpu.checkpoint_every % long_cpu.log_every == 0


# -- Serve: cluster/serve.yaml and the RayService ---------------------------------------------------


def serve_configs():
    from ray.serve.schema import ServeDeploySchema

    plain = load("cluster/serve.yaml")
    embedded = load("cluster/kuberay/rayservice-serve.yaml")["spec"]["serveConfigV2"]
    assert isinstance(embedded, str), "serveConfigV2 must be a YAML string (a `|` block)"
    return ServeDeploySchema, plain, yaml.safe_load(embedded)


def test_serve_config_and_rayservice_validate_against_serve_schema():
    from ray.serve.config import AutoscalingConfig

    schema, plain, embedded = serve_configs()
    for config in (plain, embedded):
        (app,) = schema.model_validate(config).applications
        assert app.import_path == "pipelines.serve:build_app"
        for deployment in app.deployments:  # the schema keeps autoscaling_config as a plain dict
            scaling = deployment.autoscaling_config or {}
            assert set(scaling) <= set(AutoscalingConfig.model_fields), deployment.name  # Serve ignores typos
            AutoscalingConfig(**scaling)


def test_rayservice_serves_the_same_application_as_serve_yaml():
    _, plain, embedded = serve_configs()
    assert embedded == plain, "edit cluster/serve.yaml and the RayService's serveConfigV2 together"


# -- KubeRay manifests ------------------------------------------------------------------------------

# Fields of the ray.io/v1 CRDs, in both KubeRay v1.5.1 (the first with authOptions) and master.
CLUSTER_FIELDS = set("""authOptions autoscalerOptions enableInTreeAutoscaling gcsFaultToleranceOptions headGroupSpec
    headServiceAnnotations managedBy rayVersion suspend workerGroupSpecs""".split())
HEAD_FIELDS = set("enableIngress headService labels rayStartParams resources serviceType template".split())
WORKER_FIELDS = set("""groupName idleTimeoutSeconds labels maxReplicas minReplicas numOfHosts rayStartParams replicas
    resources scaleStrategy suspend template""".split())
WORKER_REQUIRED = {"groupName", "minReplicas", "maxReplicas", "template"}
RAYJOB_FIELDS = set("""activeDeadlineSeconds backoffLimit clusterSelector deletionStrategy entrypoint entrypointNumCpus
    entrypointNumGpus entrypointResources jobId managedBy metadata rayClusterSpec runtimeEnvYAML
    shutdownAfterJobFinishes submissionMode submitterConfig submitterPodTemplate suspend ttlSecondsAfterFinished""".split())
RAYSERVICE_FIELDS = set("""deploymentUnhealthySecondThreshold excludeHeadPodFromServeSvc rayClusterConfig
    rayClusterDeletionDelaySeconds serveConfigV2 serveService serviceUnhealthySecondThreshold upgradeStrategy""".split())
# Kubernetes resource quantities, as the CRD's pattern has them.
QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")

MANIFESTS = {"cluster/kuberay/rayjob-train.yaml": ("RayJob", RAYJOB_FIELDS, "rayClusterSpec"),
             "cluster/kuberay/rayservice-serve.yaml": ("RayService", RAYSERVICE_FIELDS, "rayClusterConfig")}


def pod_groups(cluster: dict):
    yield "head", cluster["headGroupSpec"]
    for group in cluster.get("workerGroupSpecs", []):
        yield group["groupName"], group


@pytest.mark.parametrize("path", MANIFESTS)
def test_kuberay_manifest_fields(path):
    kind, spec_fields, cluster_key = MANIFESTS[path]
    doc = load(path)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == kind and doc["metadata"]["name"]
    assert set(doc["spec"]) <= spec_fields
    cluster = doc["spec"][cluster_key]
    assert set(cluster) <= CLUSTER_FIELDS and "headGroupSpec" in cluster
    assert cluster["rayVersion"] == ray.__version__
    assert cluster["authOptions"] == {"mode": "token"}
    assert set(cluster["headGroupSpec"]) <= HEAD_FIELDS
    images = set()
    for name, group in pod_groups(cluster):
        if name != "head":
            assert set(group) <= WORKER_FIELDS and WORKER_REQUIRED <= set(group), name
            assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"], name
        assert all(isinstance(v, str) for v in group.get("rayStartParams", {}).values()), name  # map of strings
        for container in group["template"]["spec"]["containers"]:
            images.add(container["image"])
            resources = container["resources"]
            assert resources["requests"] == resources["limits"], name  # Ray counts the limits
            for quantity in resources["limits"].values():
                assert QUANTITY.match(str(quantity)), (name, quantity)
    (image,) = images  # one image for every pod: the one cluster/kuberay/Dockerfile builds
    assert re.fullmatch(r"[a-z0-9.\-/]+:[\w.\-]+", image)


def pods(path: str, cluster_key: str) -> dict[str, dict]:
    """Each group's Ray resources as KubeRay derives them from the container limits."""
    out = {}
    for name, group in pod_groups(load(path)["spec"][cluster_key]):
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        cpus = float(group.get("rayStartParams", {}).get("num-cpus", limits["cpu"]))
        out[name] = {"CPU": cpus, "GPU": int(limits.get("nvidia.com/gpu", 0))}
    return out


def test_rayjob_pods_keep_trainers_and_feature_actors_apart():
    groups = pods("cluster/kuberay/rayjob-train.yaml", "rayClusterSpec")
    requests = requests_from_training_config()
    assert {g for g, node in groups.items() if fits(requests["trainer"], node)} == {"trainers"}
    assert {"features", "features-spot"} <= {g for g, node in groups.items() if fits(requests["feature actor"], node)}
    train = load("cluster/train-gpu.yaml")
    trainer_pods = load("cluster/kuberay/rayjob-train.yaml")["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    (trainers,) = [g for g in trainer_pods if g["groupName"] == "trainers"]
    assert train["num_workers"] <= trainers["maxReplicas"] * groups["trainers"]["GPU"]


def test_rayjob_entrypoint_runs_the_training_config_from_the_image():
    entrypoint = shlex.split(load("cluster/kuberay/rayjob-train.yaml")["spec"]["entrypoint"])
    assert entrypoint[:2] == ["python", "/home/ray/domino/pipelines/train.py"] and entrypoint[2] == "--config"
    assert entrypoint[3] == "/home/ray/domino/cluster/train-gpu.yaml" and (ROOT / "cluster/train-gpu.yaml").is_file()


def test_dockerfile_matches_the_launcher_setup():
    dockerfile = (ROOT / "cluster/kuberay/Dockerfile").read_text()
    assert re.search(r"^FROM (\S+)$", dockerfile, re.M).group(1) == IMAGE
    for package, version in makefile_pins().items():
        assert f"{package}=={version}" in dockerfile
    assert "pip install --no-cache-dir -e ." in dockerfile
    for line in re.findall(r"^COPY --chown=\S+ (.+) \S+$", dockerfile, re.M):
        for source in line.split():
            assert (ROOT / source).exists(), source


# -- DeepSpeed configs -------------------------------------------------------------------------------


def test_deepspeed_configs_parse_with_deepspeed():
    require("cluster/deepspeed/zero2.json")
    import json

    from deepspeed.runtime.config import DeepSpeedConfig

    for path in sorted((ROOT / "cluster/deepspeed").glob("*.json")):
        config = json.loads(path.read_text())
        config.setdefault("train_micro_batch_size_per_gpu", 1)  # the pipeline fills this in from batch_size
        DeepSpeedConfig(config)  # unknown or mistyped zero_optimization keys raise here


# -- the docs' commands ------------------------------------------------------------------------------

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = re.compile(r"(?:^|[\s;&|(])python3?\s+(?:-m\s+(?P<module>[\w.]+)|(?P<script>[\w./-]+\.py))(?P<rest>[^;&|]*)")
REPO_PATH = re.compile(r"(?<![\w/.~-])((?:cluster|pipelines|domino|docs|tests)/[\w./-]*\w)")


def shell_lines() -> list[str]:
    """Command lines from the docs: shell code blocks (continuations joined) and inline code spans."""
    lines = []
    for doc in DOCS:
        text = doc.read_text()
        for lang, block in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
            if lang in ("", "bash", "sh", "shell", "console"):
                lines += [line.split(" # ")[0] for line in block.replace("\\\n", " ").splitlines()]
        text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        lines += re.findall(r"`([^`\n]+)`", text)
    return lines


def python_commands() -> dict[str, list[list[str]]]:
    """Entry point ('pipelines/train.py', 'domino generate', ...) -> the argument lists the docs give it."""
    found: dict[str, list[list[str]]] = {}
    for line in shell_lines():
        for match in PYTHON.finditer(line):
            args = shlex.split(match["rest"], comments=True)
            entry = match["script"] or match["module"]
            if args and re.fullmatch(r"[a-z][\w-]*", args[0]):  # a subcommand: `python -m domino generate`
                entry, args = f"{entry} {args[0]}", args[1:]
            found.setdefault(("" if match["script"] else "-m ") + entry, []).append(args)
    return found


COMMANDS = python_commands()


def entry_file(entry: str) -> str | None:
    """The repository file behind an entry point (None for a module from an installed package)."""
    if not entry.startswith("-m "):
        return entry.split()[0]
    module = entry.split()[1]
    for candidate in (module.replace(".", "/") + ".py", module.replace(".", "/") + "/__main__.py"):
        if (ROOT / candidate).exists():
            return candidate
    return None


# Runs entry points with `--help` one after the other in a single interpreter, as `python -m X` /
# `python X.py` would (runpy, argv, __main__), so torch and Ray are imported once, not once per entry.
HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys
results = {}
for entry, kind, target, args in json.loads(sys.argv[1]):
    out, code = io.StringIO(), 0
    sys.argv = [target, *args, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
        except BaseException as error:
            code = 1
            print(repr(error))
    results[entry] = [code, out.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def help_outputs():
    """entry point -> (exit code, output) of its `--help`, for every entry point that exists."""
    import json

    runs = []
    for entry in COMMANDS:
        path = entry_file(entry)
        if path is not None and not (ROOT / path).exists():
            continue
        words = entry.split()
        if words[0] == "-m":
            if path is None and importlib.util.find_spec(words[1]) is None:
                continue
            runs.append([entry, "module", words[1], words[2:]])
        else:
            runs.append([entry, "script", str(ROOT / path), words[1:]])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", HELP_RUNNER, json.dumps(runs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return {entry: tuple(result) for entry, result in json.loads(done.stdout.splitlines()[-1]).items()}


def test_docs_show_python_commands():
    assert "-m domino generate" in COMMANDS and "pipelines/train.py" in COMMANDS


@pytest.mark.parametrize("entry", sorted(COMMANDS))
def test_docs_entry_point_exists_and_answers_help(entry, help_outputs):
    path = entry_file(entry)
    if path is not None:
        require(path)
    else:
        assert importlib.util.find_spec(entry.split()[1]), f"no module {entry.split()[1]}"
    code, output = help_outputs[entry]
    assert code == 0 and output.strip(), f"python {entry} --help failed:\n{output[-2000:]}"


def test_docs_training_commands_use_real_config_keys():
    require("pipelines/training/config.py")
    from pipelines.training.config import parse_args

    cwd = os.getcwd()
    os.chdir(ROOT)  # --config paths in the docs are relative to the repository root
    try:
        for args in COMMANDS["pipelines/train.py"]:
            if "--help" not in args:
                parse_args(args)  # unknown keys or bad values raise DominoError naming them
    finally:
        os.chdir(cwd)


def test_docs_name_repository_paths_that_exist():
    named = {path for line in shell_lines() for path in REPO_PATH.findall(line)}
    entrypoint = load("cluster/kuberay/rayjob-train.yaml")["spec"]["entrypoint"].replace("/home/ray/domino/", "")
    named |= set(REPO_PATH.findall(entrypoint))
    assert "cluster/aws.yaml" in named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert missing == []


def test_docs_serve_import_paths_exist():
    named = {m for line in shell_lines() for m in re.findall(r"\bserve (?:run|build) ([\w.]+):\w+", line)}
    for module in sorted(named):
        require(module.replace(".", "/") + ".py")


def test_docs_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = {m for line in shell_lines() for m in re.findall(r"^make ([\w-]+)", line.strip())}
    assert named and named <= targets
