"""The one exception type for bad input: the CLI prints its message, with no traceback."""


class UpcycleError(ValueError):
    """A user-facing error: wrong arguments, unsupported model, missing data, existing output."""
