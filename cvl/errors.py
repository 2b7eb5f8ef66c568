"""One exception type for user-facing errors: the CLI prints its message on one line, exit 2."""

from __future__ import annotations


class CvlError(Exception):
    """A problem with the user's input or files, reported without a traceback.

    Raised in a DataLoader worker, torch re-raises it in the main process as
    `CvlError("Caught CvlError in DataLoader worker process N.\\nOriginal Traceback ...")`;
    the message is cut back to the original one line (subclasses alike: `ShardError`).
    """

    def __init__(self, message: object = "", *args: object) -> None:
        text = str(message)
        name = type(self).__name__
        if text.startswith(f"Caught {name}") and "\nOriginal Traceback" in text:
            message = text.rsplit(f"{name}: ", 1)[-1].strip()
        super().__init__(message, *args)
