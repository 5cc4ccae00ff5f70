"""The one base class for errors a user can act on.

The CLI prints these without a traceback (``--debug`` shows it); anything else
is a bug in fxpipe and keeps its traceback.
"""


class FxpipeError(Exception):
    """An error whose message names the file, node or parameter and the way out."""
