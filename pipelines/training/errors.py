"""Turning an exception from deep inside Ray into the one line a user needs."""

from __future__ import annotations

import sys
from collections.abc import Callable

from domino.errors import DominoError

RAY_ADVICE = ("Failed to ", "To change retry attempts")  # notes Ray Data appends to the errors it retried


def root_cause(error: BaseException) -> str:
    """The innermost message of an error that crossed Ray's task and actor boundaries: a DominoError's
    text when there is one, else the innermost error's own message."""
    failures = getattr(error, "worker_failures", None)  # Ray Train: rank -> the error that worker raised
    if failures:
        error = next(iter(failures.values()))
    while getattr(error, "cause", None) is not None and error.cause is not error:  # RayTaskError wrappers
        error = error.cause
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 text ({error.reason} at byte {error.start})"
    lines = [line.strip() for line in str(error).strip().splitlines()]
    lines = [line for line in lines if line and not line.startswith(RAY_ADVICE)]
    domino = [line for line in lines if "DominoError:" in line]
    if domino:
        return domino[-1].split("DominoError:", 1)[1].strip()
    return lines[-1] if lines else type(error).__name__


def exit_status(command: Callable[[], object]) -> int:
    """Run a command line's body: bad input (a DominoError) becomes one line on stderr and exit status 2,
    never a traceback."""
    try:
        command()
    except DominoError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
