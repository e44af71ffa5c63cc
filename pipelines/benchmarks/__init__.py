"""Every benchmark behind `python -m pipelines.bench COMMAND`: the side-by-side harness (prompt sets,
methods, reports) and the scripts that measure single pieces."""
