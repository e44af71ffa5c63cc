"""Every benchmark behind `python -m pipelines.bench COMMAND`: the side-by-side harness (prompt sets,
methods, reports) and the scripts that measure single pieces."""

import argparse


TARGET_HELP = "the target model: a model folder, a hub id, or the embedded default"


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every benchmark's --help: its module docstring as written, and each option's default."""
