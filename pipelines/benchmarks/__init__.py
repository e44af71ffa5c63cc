"""Every benchmark behind `python -m pipelines.bench COMMAND`: the side-by-side harness (prompt sets,
methods, reports) and the scripts that measure single pieces."""

import argparse


TARGET_HELP = "the target model: a model folder, a hub id, or the embedded default"


def rotated(items: list, start: int) -> list:
    """`items` from index start % len(items) on, then the rest: prompt i's order of methods, so that methods
    alternating prompt by prompt each go first in turn."""
    first = start % len(items)
    return items[first:] + items[:first]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every benchmark's --help: its module docstring as written, and each option's default (none for a
    required option, or where the help text says what the default means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or (action.default is None and "(default" in (action.help or "")):
            return action.help
        return super()._get_help_string(action)
