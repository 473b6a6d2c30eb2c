"""The server's error answers: an APIError as a JSON response in the shape of the API its path belongs to
(OpenAI's, or Anthropic's), and the APIError an engine refusal or failure of a request becomes."""

from __future__ import annotations

from aiohttp import web

from ..errors import (APIError, EngineStepError, EngineStoppedError, InvalidParameterError, PromptRefused,
                      PromptTooLongError, QueueFullError)
from ..sampling import NO_TOKEN_ALLOWED
from ..tokenizer import ChatTemplateError
from .fields import bad_request
from .generate_request import GenerateRequest
from .render_anthropic import error_body, is_messages_path
from .state import json_response

RETRY_AFTER_SECONDS = 1  # a full queue's 429 says when to try again; the openai client waits that long, then retries


def error_response(error: APIError, headers: dict[str, str] | None = None, path: str = "") -> web.Response:
    return json_response(api_error_body(error, path), error.status, headers)


def api_error_body(error: APIError, path: str) -> dict:
    """The error's body in the shape of the API that `path` belongs to (OpenAI's, or Anthropic's)."""
    return error_body(error) if is_messages_path(path) else error.body()


def engine_error(error: BaseException, req: GenerateRequest) -> APIError:
    """The HTTP error for an engine refusal or failure (naming the prompt of a batch that it concerns)."""
    prompt_param = req.prompt_param or ("messages" if req.chat else "prompt")
    prompt = ""
    if isinstance(error, PromptRefused):
        prompt, error = f"prompt {error.index}: ", error.error
    if isinstance(error, PromptTooLongError):
        return bad_request(f"{prompt}this model's maximum context length is {error.max_seq_len} tokens: {error}",
                           param=prompt_param, code="context_length_exceeded")
    if isinstance(error, InvalidParameterError):  # SamplingParams' grammar: the field that asked for it
        param = req.grammar_param if error.param == "grammar" and req.grammar_param else error.param
        return bad_request(f"{prompt}{error}", param=param)
    if isinstance(error, ChatTemplateError):
        return bad_request(str(error), param=prompt_param)
    if isinstance(error, QueueFullError):
        return APIError(429, f"the server is busy: {error}", type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(error, EngineStepError) and str(error) == NO_TOKEN_ALLOWED:  # the request's own constraints
        return bad_request(f"{prompt}{error} (min_tokens asks for more tokens than the output format, if any, and "
                           f"stop_token_ids let the model write)", param="min_tokens")
    if isinstance(error, EngineStoppedError):
        return APIError(503, f"the engine is not accepting requests: {error}", type="server_error",
                        code="shutting_down")
    return APIError(500, f"generation failed: {error}", type="server_error")
