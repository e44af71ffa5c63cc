"""The Serve configs (cluster/serve.yaml, the benchmark's A/B config) against Ray Serve's own schema
and the application's arguments."""

import importlib
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
