import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py

# Tiny test models run fastest on one thread, and a second thread only adds contention when other
# processes (Ray workers, replicas) share the machine's cores.
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]

# The suite runs on 2 pytest-xdist workers, a file at a time (pyproject.toml). The longest files start
# first, so that the last one to finish does not start late; within a file the order is kept. The
# pipeline's file must also come before any test that starts the session's Ray cluster in the same
# process: it connects this process to a `ray start` cluster of its own.
LONGEST_FIRST = ["test_pipeline_ray.py", "test_serve.py", "test_sampling.py", "test_decoding.py"]

# Settings for the session's Ray cluster: Serve's autoscaling metrics and the Prometheus export are
# pushed every few seconds instead of every ten, so the autoscaling and metrics tests finish quickly.
FAST_RAY_ENV = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_metrics_report_interval_ms": "1000",
}


@pytest.fixture(scope="session")
def embedded_target():
    """The real SmolLM2-135M target (converted from its GGUF once per machine, then cached)."""
    from domino.target import Target

    return Target.load("smollm2-135m")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the session: its own temp dir, no dashboard, random ports, so it never
    touches another cluster on the machine. Its workers import this checkout (PYTHONPATH)."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="domino-ray-", dir="/tmp")  # short: Ray's socket paths must fit
    with pytest.MonkeyPatch.context() as env:
        for key, value in FAST_RAY_ENV.items():
            env.setenv(key, value)
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = Path(str(item.fspath)).name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # stable: each file keeps its own order
