"""The Serve configs (cluster/serve.yaml, the benchmark's A/B config) against Ray Serve's own schema
and the application's arguments."""

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from pipelines.serve import EngineReplica, OpenAIServer, ServeArgs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", ["cluster/serve.yaml", "pipelines/benchmarks/serve_ab.yaml"])
def test_serve_config_is_valid_for_serve_deploy(path):
    config = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / path).read_text()))
    for app in config.applications:
        module, attribute = app.import_path.split(":")
        assert callable(getattr(importlib.import_module(module), attribute))
        ServeArgs.model_validate(app.args)  # the builder would accept them
        for deployment in app.deployments:
            assert deployment.name in (EngineReplica.name, OpenAIServer.name)


def test_cluster_config_autoscales():
    config = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "cluster/serve.yaml").read_text()))
    (deployment,) = [d for d in config.applications[0].deployments if d.name == EngineReplica.name]
    scaling = deployment.autoscaling_config
    assert 1 <= scaling["min_replicas"] < scaling["max_replicas"]
    assert scaling["target_ongoing_requests"] <= deployment.max_ongoing_requests


def test_the_builder_refuses_what_the_replicas_could_not_start_with(tmp_path, embedded_target):
    """Checked where the application is built: a replica failing in its constructor is retried and Serve
    goes on serving nothing, so `serve run` must end with the reason instead."""
    from domino.errors import DominoError
    from pipelines.serve import build_app
    from helpers import tiny_drafter, tiny_target
    from pipeline_helpers import save_tiny_chat_target

    with pytest.raises(DominoError, match="no drafter checkpoint at"):
        build_app({"drafter": str(tmp_path / "gone")})
    with pytest.raises(DominoError, match="verify 'confidence' needs a drafter trained with a confidence head.*without a drafter has none"):
        build_app({"drafter": "none", "verify": "confidence"})
    with pytest.raises(DominoError, match=f"target '{tmp_path / 'no-model'}' not found"):
        build_app({"target": str(tmp_path / "no-model")})
    tiny_drafter(tiny_target()).save_pretrained(tmp_path / "other")
    with pytest.raises(DominoError, match="made for a target with hidden size 64 .* but 'smollm2-135m' has 576"):
        build_app({"drafter": str(tmp_path / "other")})
    for confident in (False, True):
        tiny_drafter(embedded_target, confidence_head=confident).save_pretrained(tmp_path / str(confident))
    with pytest.raises(DominoError, match="verify 'threshold' needs.*this drafter has none"):
        build_app({"drafter": str(tmp_path / "False"), "verify": "threshold"})
    build_app({"drafter": str(tmp_path / "True"), "verify": "confidence"})
    build_app({"drafter": str(tmp_path / "False"), "verify": "gated"})
    with pytest.raises(DominoError, match="the drafter drafts blocks of 8 tokens, not 4"):  # as the engine would
        build_app({"drafter": str(tmp_path / "False"), "block_size": "4"})
    weights = tmp_path / "True" / "model.safetensors"  # the weights are checked too, not only the config
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(DominoError, match="the checkpoint is incomplete or corrupt"):
        build_app({"drafter": str(tmp_path / "True")})
    tiny_drafter(embedded_target, num_layers=1).save_pretrained(tmp_path / "one")
    shutil.copy(tmp_path / "False" / "model.safetensors", tmp_path / "one")  # two layers
    with pytest.raises(DominoError, match="the weights in .*one do not match its config"):
        build_app({"drafter": str(tmp_path / "one")})
    target = save_tiny_chat_target(tmp_path / "target")  # the target's weights by their headers alone
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(DominoError, match="target/model.safetensors, the checkpoint is incomplete or corrupt"):
        build_app({"target": str(target)})


def test_importing_the_serve_module_builds_no_application():
    """Replicas import it: `pipelines.serve:app` is built when asked for, not at every import."""
    import pipelines.serve
    from ray.serve import Application

    assert "app" not in vars(pipelines.serve) and isinstance(pipelines.serve.app, Application)


@pytest.mark.parametrize("argument, message", [
    ("drafter=/no/such/drafter", "Error: no drafter checkpoint at /no/such/drafter"),
    ("num_cpus=two", "Error: bad application arguments (num_cpus: Input should be a valid number"),
])
def test_serve_run_names_a_bad_argument_in_one_line(argument, message):
    """Through Serve's own command line (the builder runs before it starts Ray): the reason, no traceback."""
    done = subprocess.run([str(Path(sys.executable).parent / "serve"), "run", "pipelines.serve:build_app", argument],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert message in done.stderr and "Traceback" not in done.stderr + done.stdout, done.stderr
