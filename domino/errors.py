"""The one exception type users see: its message says what went wrong and how to fix it."""


class DominoError(ValueError):
    """Bad input or configuration. Command lines print the message on one line, without a traceback."""
