"""The one error type users see: a message that names the file and the fix."""


class OcriaError(Exception):
    """Bad input or state the user can fix. The CLI prints it without a traceback."""
