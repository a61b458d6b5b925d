"""The one exception type users see: its message says what is wrong and what to do."""


class TiergenError(Exception):
    """A user-facing error (bad input, missing file, unsupported model, ...).

    The CLI prints its message on one line and exits with status 2.
    """
