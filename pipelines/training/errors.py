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
    chain = [error]  # RayTaskError wrappers hold the error in `cause`
    while getattr(chain[-1], "cause", None) is not None and chain[-1].cause is not chain[-1]:
        chain.append(chain[-1].cause)
    for level in reversed(chain):  # a wrapper's text may be all that keeps the worker's traceback (Ray Data's "UDF failed")
        domino = [line for line in str(level).splitlines() if "DominoError:" in line]
        if domino:
            return domino[-1].split("DominoError:", 1)[1].strip()
    lines = [line.strip() for line in str(chain[-1]).strip().splitlines()]
    lines = [line for line in lines if line and not line.startswith(RAY_ADVICE)]
    return lines[-1] if lines else type(chain[-1]).__name__


def exit_status(command: Callable[[], object]) -> int:
    """Run a command line's body: bad input (a DominoError) becomes one line on stderr and exit status 2,
    and Ctrl-C one line and status 130, never a traceback. A body that returns an int exits with it (a
    load test with failed requests, say); any other value is success."""
    try:
        result = command()
    except DominoError as error:  # one raised in a Ray task arrives wrapped, with the task's traceback
        print(f"error: {root_cause(error) if getattr(error, 'cause', None) is not None else error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return result if isinstance(result, int) else 0
