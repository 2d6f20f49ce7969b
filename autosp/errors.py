"""User-facing errors.

Every error a user can cause by bad input is an :class:`AutospError` whose
message is one line that names the problem *and* the fix. The CLI prints the
message alone (no traceback); library callers can catch the class.
"""


class AutospError(ValueError):
    """Bad input or an unsupported model; the message says what to do instead."""
