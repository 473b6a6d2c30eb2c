"""Every exception type of Colibri, each carrying one clear line for the user.

Every error a user can cause (a bad model folder, an unsupported checkpoint, a bad argument, a bad request) is
raised as one of these; the CLI prints `error: <message>` and exits non-zero instead of a traceback, and the server
answers a ColibriError of a request as an APIError (server/error_replies.py).
"""

from __future__ import annotations


class ColibriError(Exception):
    """Base of every error Colibri reports to a user."""


class CheckpointError(ColibriError):
    """A model folder is missing, corrupt, or does not match its config."""


class UnsupportedModelError(ColibriError):
    """A Hugging Face checkpoint uses an architecture or option Colibri does not implement."""


class RequestsAbortedError(ColibriError):
    """The server stopped with requests still running (its drain timed out, or a second signal came): they were
    aborted, so `colibri serve` exits non-zero."""


class ConfigError(ColibriError):
    """An engine option is missing, unknown or out of range; the message names it."""


class InvalidParameterError(ColibriError):
    """A sampling parameter is out of range; the message names the parameter."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class PromptTooLongError(ColibriError):
    """A prompt, with the tokens it asks for, does not fit in the engine's max_seq_len."""

    def __init__(self, prompt_tokens: int, max_tokens: int | None, max_seq_len: int):
        if max_tokens is None:
            message = (f"the prompt has {prompt_tokens} tokens, which leaves no room for output in max_seq_len "
                       f"{max_seq_len}")
        else:
            message = (f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}: "
                       f"{prompt_tokens + max_tokens} exceeds max_seq_len {max_seq_len}")
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_seq_len = max_seq_len


class QueueFullError(ColibriError):
    """The engine's waiting queue is at max_queue; the client may retry later."""


class EngineStoppedError(ColibriError):
    """The engine is not running (not started, stopping, or stopped after a failure)."""


class ExpertParallelError(ColibriError):
    """A rank of an expert-parallel group died, failed a step or went silent past the collectives' timeout: the
    group cannot step again, and its requests fail with this."""


class EngineStepError(ColibriError):
    """A model step failed while computing this request; the engine aborted the step's requests and goes on."""


class GrammarError(ColibriError):
    """A sequence's grammar failed while it was generating (llguidance reached one of its limits on this path);
    the sequence's request ends with it, the others go on."""


class RequestsFailedError(ColibriError):
    """Raised by `EngineCore.step` when requests failed alone in it (already aborted): `errors` maps each to its
    EngineStepError, `outputs` holds what the step produced for the other requests (`request.RequestOutput`s:
    this module imports nothing of the engine's)."""

    def __init__(self, outputs: list, errors: dict[str, EngineStepError]):
        super().__init__("; ".join(f"request {request_id}: {error}" for request_id, error in errors.items()))
        self.outputs = outputs
        self.errors = errors


class PromptRefused(ColibriError):
    """The refusal of one prompt of a batch: what the engine raised (`error`) and the prompt's `index`."""

    def __init__(self, error: ColibriError, index: int):
        super().__init__(f"prompt {index}: {error}")
        self.error, self.index = error, index


class APIError(Exception):
    """An HTTP error of the server, answered as OpenAI does: HTTP `status` and {"error": {"message", "type",
    "param", "code"}} (on the Messages API's routes in Anthropic's shape, server/render_anthropic.py). Not a
    ColibriError: the generation handler turns the engine's ColibriErrors into APIErrors (server/error_replies.py)
    and lets these pass as they are."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # sent with the error (Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def describe(error: BaseException) -> str:
    """The one line a user reads for an exception: a ColibriError's message alone (its class is this package's
    business), another exception's class and message as Python's traceback ends with them (never the repr)."""
    if isinstance(error, ColibriError):
        return str(error) or type(error).__name__
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
