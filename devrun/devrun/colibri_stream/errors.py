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
