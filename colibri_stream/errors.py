"""Exceptions that carry one clear line for the user.

Every error a user can cause (a bad model folder, an unsupported checkpoint, a bad argument) is raised as one of
these; the CLI prints `error: <message>` and exits non-zero instead of a traceback.
"""


class ColibriError(Exception):
    """Base of every error Colibri reports to a user."""


class CheckpointError(ColibriError):
    """A model folder is missing, corrupt, or does not match its config."""


class UnsupportedModelError(ColibriError):
    """A Hugging Face checkpoint uses an architecture or option Colibri does not implement."""


class RequestsAbortedError(ColibriError):
    """The server stopped with requests still running (its drain timed out, or a second signal came): they were
    aborted, so `colibri serve` exits non-zero."""


def describe(error: BaseException) -> str:
    """The one line a user reads for an exception: a ColibriError's message alone (its class is this package's
    business), another exception's class and message as Python's traceback ends with them (never the repr)."""
    if isinstance(error, ColibriError):
        return str(error) or type(error).__name__
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
