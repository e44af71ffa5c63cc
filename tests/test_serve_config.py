"""cluster/serve.yaml against Ray Serve's own schema and the application's arguments."""

import importlib
from pathlib import Path

import yaml
from ray.serve.schema import ServeDeploySchema

from pipelines.serve import OpenAIServer, ServeArgs

CONFIG = Path(__file__).resolve().parents[1] / "cluster" / "serve.yaml"


def test_serve_config_is_valid_for_serve_deploy():
    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app,) = config.applications
    module, attribute = app.import_path.split(":")
    assert getattr(importlib.import_module(module), attribute) is not None
    ServeArgs.model_validate(app.args)  # the builder would accept them
    (deployment,) = app.deployments
    assert deployment.name == OpenAIServer.name
    scaling = deployment.autoscaling_config
    assert 1 <= scaling["min_replicas"] < scaling["max_replicas"]
    assert scaling["target_ongoing_requests"] <= deployment.max_ongoing_requests
