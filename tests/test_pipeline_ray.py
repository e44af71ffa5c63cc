"""The training pipeline end to end on a real Ray cluster that the tests start (`ray start --head`) and
stop, with a tiny chat target: submitted with `ray job submit`, Ray Data feature actors stream into 2
DeepSpeed ZeRO-2 trainers over gloo, a worker is killed mid-run and the run finishes from its
checkpoint; bad input is stopped with one clear line before any work and never costs a checkpoint."""

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from logging.handlers import BufferingHandler
from pathlib import Path

import pytest
import ray

from domino.drafter import Drafter
from domino.errors import DominoError
from domino.target import Target
from domino.training import BUDGET_PROBE, BUDGET_WARMUP
from pipelines.training.checkpoints import TEMP_PREFIX, latest
from pipelines.training.config import build_config
from pipelines.train import main, run
from pipeline_helpers import conversation, save_tiny_chat_target, write_jsonl

REPO = Path(__file__).resolve().parents[1]
# what a feature or array cache would leave behind
ARRAY_SUFFIXES = {".npy", ".npz", ".parquet", ".arrow", ".feather", ".pt", ".safetensors", ".bin"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "ray start --head exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


def start_head(root: Path, env: dict, attempts: int = 3) -> tuple[subprocess.Popen, dict[str, int]]:
    """`ray start --head --block` on free ports. A port found free can be taken by another process (the
    other test worker's Ray) before this head binds it, and then the head exits: try again on new ports."""
    for attempt in range(1, attempts + 1):
        ports = {name: free_port() for name in ("port", "dashboard-port", "ray-client-server-port", "node-manager-port",
                                                "object-manager-port", "metrics-export-port", "runtime-env-agent-port",
                                                "dashboard-agent-listen-port", "dashboard-agent-grpc-port")}
        log = root / f"head-{attempt}.log"
        head = subprocess.Popen(
            [str(Path(sys.executable).parent / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", "--num-cpus=4",
             "--include-dashboard=true", f"--temp-dir={root / 'ray'}", "--disable-usage-stats", "--block",
             *(f"--{name}={port}" for name, port in ports.items())],
            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        try:
            wait_for_port(ports["port"], head)
            wait_for_port(ports["dashboard-port"], head)
            return head, ports
        except AssertionError:  # it exited: try new ports
            continue
        except TimeoutError:  # it runs but does not listen: stop it by its PID, as the fixture would
            head.send_signal(signal.SIGTERM)
            head.wait(timeout=60)
            raise
    raise AssertionError(f"ray start --head exited {attempts} times; the last log ends:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def cluster():
    """A `ray start --head` cluster of our own (own ports, own temp dirs), stopped by its PID. Token auth is
    off: this process imported Ray before the cluster existed and cannot turn it on for an explicit address. TMPDIR points its processes at a folder the tests inspect. The root
    is short: Ray's socket paths under it must fit in 107 bytes."""
    root = Path(tempfile.mkdtemp(prefix="domino-", dir="/tmp"))
    (root / "tmp").mkdir()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TMPDIR": str(root / "tmp"),
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # stop at once when the tests end
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    head, ports = start_head(root, env)
    try:
        ray.init(address=f"127.0.0.1:{ports['port']}", logging_level="warning")
        yield {"root": root, "env": env, "dashboard": f"http://127.0.0.1:{ports['dashboard-port']}",
               "address": f"127.0.0.1:{ports['port']}"}
    finally:
        ray.shutdown()
        head.send_signal(signal.SIGTERM)  # `ray start --block` drains and stops everything it started
        head.wait(timeout=60)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, embedded_target):
    root = tmp_path_factory.mktemp("inputs")
    rows = [conversation(i, "sharegpt" if i % 2 else "openai") for i in range(40)] + ["{not json", '{"foo": 1}']
    return {"target": str(save_tiny_chat_target(root / "target")),
            "data": str(write_jsonl(root / "chats.jsonl", rows)), "root": root}


def settings(inputs, storage, **overrides) -> dict:
    """A small run: 2 ZeRO-2 workers, 12 steps, checkpoints every 4."""
    values = dict(target=inputs["target"], data=inputs["data"], storage_path=str(storage), run_name="tiny",
                  max_conversations=0, max_length=64, max_malformed_fraction=0.1, eval_prompts=0,
                  regenerate=False, regenerate_tokens=12, regenerate_actors=1, regenerate_batch_size=8,
                  feature_cpus=0.5, data_cpus=0.25, num_workers=2, batch_size=2, anchors_per_sequence=4,
                  rank=8, block_size=4, steps=12, lr=3e-3, log_every=2, checkpoint_every=4, max_failures=1)
    return {**values, **overrides}


def config(inputs, storage, **overrides):
    return build_config(settings(inputs, storage, **overrides))


RAY_PROCESS_LINE = re.compile(r"(\x1b\[\d+m)?\(\w")  # a line a Ray worker or actor printed, "(Name pid=...)"


def write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


# The submitted job's length: a ceiling of 200 steps and a budget that start-up alone exceeds, so the
# resumed workers, fitting it at their 25th step, keep the least a fit keeps: one step more.
BUDGETED = dict(steps=200, minutes=0.1)


@pytest.fixture(scope="module")
def submitted(cluster, inputs, tmp_path_factory):
    """The main job through `ray job submit`: regenerated answers -> features on an actor pool -> 2 ZeRO-2
    workers over gloo; the last worker dies at step 14, the group restarts from the step-12 checkpoint, and
    the resumed workers time their steps against the budget afresh and stop together when it is spent.
    It computes in bfloat16 on any machine (auto picks it only on GPUs and CPUs with AMX)."""
    storage = tmp_path_factory.mktemp("storage")
    values = settings(inputs, storage, regenerate=True, fail_at_step=14, checkpoint_every=12, eval_prompts=2,
                      eval_max_new_tokens=8, compute_dtype="bfloat16", **BUDGETED)
    command = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", cluster["dashboard"],
               "--working-dir", str(REPO), "--", "python", "pipelines/train.py", *(f"{k}={v}" for k, v in values.items())]
    done = subprocess.run(command, env=cluster["env"], capture_output=True, text=True, timeout=900)
    run_dir = storage / "tiny"
    last = max((p for p in run_dir.glob("step_*")), default=None)
    fitted = json.loads((last / "state.json").read_text())["planned_steps"] if last else None
    return {"logs": done.stdout + done.stderr, "rc": done.returncode, "run_dir": run_dir, "storage": storage,
            "fitted": fitted}


def test_job_trains_two_zero2_workers_through_a_killed_worker(submitted, inputs):
    logs, fitted = submitted["logs"], submitted["fitted"]
    assert submitted["rc"] == 0 and "succeeded" in logs, logs[-3000:]
    assert "[regenerate] 38 answers by the target (" in logs  # 2 prompts held out for the evaluation
    assert "fault injection: worker 1 dies at step 14" in logs
    assert "2 worker(s)" in logs and "computing in bfloat16" in logs and "resuming at step 12" in logs
    # the resumed run timed 20 steps from its 17th (12 + 5 of warm-up) before it fitted the budget
    assert 12 + BUDGET_WARMUP + BUDGET_PROBE < fitted < BUDGETED["steps"]
    assert "[train] step 2/200 " in logs and f"[train] step {fitted}/{fitted} " in logs and "data wait [" in logs
    assert f"[train] the time budget of 0.1 minutes kept {fitted} of the 200 steps" in logs
    # the closing evaluation: tau of the untrained and the exported drafter on the held-out prompts
    assert "| untrained | 2 |" in logs and f"| trained (step {fitted}) | 2 |" in logs

    run_dir = submitted["run_dir"]
    kept = sorted(p.name for p in run_dir.iterdir() if p.is_dir())  # keep 2: the last multiple of 12 and the end
    assert kept == [f"step_{(fitted - 1) // 12 * 12:06d}", f"step_{fitted:06d}"]
    last = run_dir / kept[-1]
    state = json.loads((last / "state.json").read_text())
    # the DeepSpeed engine resumed its own step count too: 12 before the fault + the rest after it
    assert state["step"] == state["optimizer_steps"] == state["planned_steps"] == fitted and state["world_size"] == 2
    shards = {p.name for p in (last / "deepspeed").iterdir()}
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= shards
    drafter = Drafter.from_pretrained(last / "drafter", Target.load(inputs["target"]))
    assert drafter.config.block_size == 4


def test_nothing_but_checkpoints_is_written(submitted, cluster):
    run_dir = submitted["run_dir"]
    # outside the checkpoint folders, storage holds only Ray Train's small run records
    for path in files_under(run_dir):
        if not path.relative_to(run_dir).parts[0].startswith("step_"):
            assert path.suffix not in ARRAY_SUFFIXES and path.stat().st_size < 64_000, path
    # no feature arrays, spilled objects or checkpoint staging folders in the cluster's temp dirs
    leftovers = [p for p in files_under(cluster["root"])
                 if p.suffix in ARRAY_SUFFIXES or "spill" in p.name or TEMP_PREFIX in str(p)]
    assert leftovers == []


def test_rerunning_never_loses_checkpoints(submitted, inputs, capfd):
    run_dir, storage = submitted["run_dir"], submitted["storage"]
    before = {p: p.stat().st_mtime for p in files_under(run_dir)}
    # the same run again: already trained (to the steps its budget kept), nothing is redone
    assert run(config(inputs, storage, regenerate=True, lr=1e-3, **BUDGETED)).metrics is None
    out = capfd.readouterr().out
    assert f"already trained to step {submitted['fitted']}" in out and "lr 0.003 -> 0.001" in out  # a setting it did not train with
    assert "[train] drafter of that step: " in out and "exported" not in out  # nothing new was written
    # another drafter under the same name is refused before any work, and so is bad data
    with pytest.raises(DominoError, match=r"trained another drafter \(block_size 4 -> 6\)"):
        run(config(inputs, storage, block_size=6))
    with pytest.raises(DominoError, match="was trained by 2 workers"):
        run(config(inputs, storage, num_workers=1))
    with pytest.raises(DominoError, match="does not exist"):
        run(config(inputs, storage, data=str(storage / "missing.jsonl")))
    assert {p: p.stat().st_mtime for p in files_under(run_dir)} == before


def test_a_run_resumes_from_the_newest_checkpoint_ray_train_recorded(submitted, inputs, tmp_path):
    """A job stopped while it wrote checkpoints can leave newer step folders, perhaps cut short, that Ray
    Train never recorded as complete; the trainers resume from the newest it recorded, and the job must say
    that one, not the newest folder (it said step 50 while the trainers resumed at 30)."""
    run_dir = tmp_path / "tiny"
    shutil.copytree(submitted["run_dir"], run_dir)
    recorded = max(p for p in run_dir.glob("step_*"))
    unrecorded = run_dir / "step_000999"  # as an interrupted upload leaves it
    shutil.copytree(recorded, unrecorded)
    state = json.loads((unrecorded / "state.json").read_text())
    (unrecorded / "state.json").write_text(json.dumps({**state, "step": 999}))
    last = latest(config(inputs, tmp_path, regenerate=True, **BUDGETED))
    assert (last.step, last.uri) == (submitted["fitted"], str(recorded))


def test_ctrl_c_while_training_ends_in_one_line(cluster, inputs, tmp_path):
    """Ray Train answers Ctrl-C by aborting the run, after which its driver's wait ended in SystemExit(1):
    the job exited 1 without a word. It must say what is kept and exit 130, as at any other moment. (Sent
    as the trainer starts: the same path as later, without the minute the feature actors take to start.)"""
    values = settings(inputs, tmp_path / "runs", num_workers=1, steps=400)
    job = subprocess.Popen([sys.executable, "pipelines/train.py", *(f"{k}={v}" for k, v in values.items())], cwd=REPO,
                           env={**cluster["env"], "RAY_ADDRESS": cluster["address"]}, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = []
    for line in job.stdout:
        seen.append(line)
        if "[train] 1 worker(s)" in line:  # the trainer runs: Ray Train's own SIGINT handler is in place
            job.send_signal(signal.SIGINT)
            break
    out = "".join(seen) + job.communicate(timeout=120)[0]
    assert job.returncode == 130, out[-3000:]
    own = [line for line in out.splitlines() if not RAY_PROCESS_LINE.match(line)]  # Ray's actors may log tracebacks as the driver goes
    assert "[train] stopped: no checkpoint was written" in out and not [line for line in own if "Traceback" in line]
    assert out.rstrip().endswith("interrupted")


@pytest.mark.parametrize("make_data, message", [
    (lambda d: write_jsonl(d / "empty.jsonl", []), "is empty"),
    (lambda d: write_jsonl(d / "bad.jsonl", ["{oops"] * 3 + [conversation(0)] * 5),
     r"3 of 8 rows of .* are malformed, more than max_malformed_fraction=0.1: .*not valid JSON: 3"),
    (lambda d: write_jsonl(d / "few.jsonl", [conversation(0), conversation(1)]),
     "has 2 conversations to train on, fewer than one batch for every worker"),
    (lambda d: write_bytes(d / "broken.parquet", b"not parquet at all"),
     "cannot read .*broken.parquet: .*Parquet magic bytes not found"),
    (lambda d: write_bytes(d / "latin1.jsonl", '{"messages": "caf\xe9"}\n'.encode("latin-1")),
     r"cannot read .*latin1.jsonl: .*latin1.jsonl is not UTF-8 text \(invalid continuation byte at byte 17\)"),
])
def test_bad_data_stops_before_training(cluster, inputs, tmp_path, make_data, message):
    data = make_data(tmp_path)
    ray_data_log, kept = logging.getLogger("ray.data"), BufferingHandler(capacity=1000)
    ray_data_log.addHandler(kept)
    try:
        with pytest.raises(DominoError, match=message) as error:
            run(config(inputs, tmp_path / "runs", data=str(data)))
    finally:
        ray_data_log.removeHandler(kept)
    assert "\n" not in str(error.value)
    assert not [r.getMessage() for r in kept.buffer if r.levelno >= logging.ERROR]  # Ray Data's say less than ours
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("overrides, message", [
    (dict(use_gpu=True), r"holds 2 GPUs at once \(num_workers x trainer_gpus \(use_gpu\).*the local Ray cluster has 0"),
    (dict(feature_gpus=1), "holds 1 GPUs at once"),
    (dict(trainer_cpus=3), r"holds 6.5 CPUs at once \(num_workers x trainer_cpus \+ feature_actors x feature_cpus\)"),
])
def test_a_job_the_cluster_cannot_hold_is_refused_instead_of_waiting_for_ever(cluster, inputs, tmp_path, overrides,
                                                                              message):
    """On a cluster the job was not submitted to (so no autoscaler adds nodes), actors the cluster cannot
    place would wait for ever: the job is refused before any work."""
    with pytest.raises(DominoError, match=message):
        run(config(inputs, tmp_path / "runs", **overrides))
    assert not (tmp_path / "runs").exists()


def test_storage_that_cannot_hold_checkpoints_is_named_in_one_line(cluster, inputs, tmp_path):
    (tmp_path / "file").write_text("")
    for storage in (tmp_path / "file", Path("/proc/domino-runs")):
        with pytest.raises(DominoError, match=f"cannot write checkpoints to {storage}: ") as error:
            run(config(inputs, storage))
        assert "\n" not in str(error.value)
    with pytest.raises(DominoError, match="storage_path: String should have at least 1 character"):
        config(inputs, "")


def test_command_line_errors_are_one_line_without_traceback(capsys):
    assert main(["stepz=3"]) == 2
    err = capsys.readouterr().err
    assert err == "error: unknown config key 'stepz' (did you mean 'steps'?)\n"
    assert main(["--help"]) == 0
    assert "checkpoint_every = 200" in capsys.readouterr().out
