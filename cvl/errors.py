"""One exception type for user-facing errors: the CLI prints its message on one line, exit 2."""


class CvlError(Exception):
    """A problem with the user's input or files, reported without a traceback."""
