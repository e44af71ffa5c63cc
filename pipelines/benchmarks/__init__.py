"""Every benchmark behind `python -m pipelines.bench COMMAND`: the side-by-side harness (prompt sets,
methods, reports) and the scripts that measure single pieces."""

import argparse


TARGET_HELP = "the target model: a model folder, a hub id, or the embedded default"


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every benchmark's --help: its module docstring as written, and each option's default (none for a
    required option, or where the help text says what the default means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or (action.default is None and "(default" in (action.help or "")):
            return action.help
        return super()._get_help_string(action)
