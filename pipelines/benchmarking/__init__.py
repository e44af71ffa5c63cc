"""The benchmark harness behind `python -m pipelines.bench`: prompt sets, methods, reports."""
