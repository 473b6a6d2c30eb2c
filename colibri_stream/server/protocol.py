"""The OpenAI wire format: request validation into SamplingParams, response and chunk bodies, error bodies.

Unknown fields are ignored (as vLLM does; OpenAI refuses them, but clients written for vLLM-style servers send
extensions of their own). Otherwise requests follow OpenAI's rules: a known field of the wrong type or out of range
is a 400 naming the field, and a feature this server does not implement (the legacy functions,
images, audio output, echo in chat, suffix for a model without fill-in-the-middle tokens, best_of > n, vLLM's
continue_final_message) is a 400 that says so
instead of being silently dropped; so are the fields of the other endpoint that would change the answer
(max_completion_tokens, top_logprobs or messages sent to /v1/completions, a prompt sent to chat). `response_format`
json_object and json_schema (chat and, as vLLM, completions) constrain the text to JSON (structured.py), as do
vLLM's `structured_outputs` and `guided_*` fields to a schema, regex, choice or Lark grammar (structured_outputs.py); a
forced tool call (tool_choice "required" or a named function) is written under its tools' schemas (tools.py);
with tool_choice "auto" the calls the model writes in its template's syntax become tool_calls (tool_syntax.py;
streamed as they are written; a model whose template teaches no syntax answers in text), and a thinking model's
<think> text becomes the message's reasoning_content (reasoning.py).
Types are as strict as OpenAI's: no number in a string, no boolean for a number, no 2.0 for an integer; null is the
same as leaving a field out. The values of those features that ask for nothing (`tools: []`,
`tool_choice: "none"` or `"auto"`, `response_format: {"type": "text"}`, `modalities: ["text"]`, `echo: false`,
`suffix: ""`, `best_of` equal to n) are accepted, and so are tools with `tool_choice: "none"` (as vLLM without a
tool parser: the tools are ignored). The vLLM extensions `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`,
`ignore_eos`, `min_tokens` (end-of-sequence and stop tokens are not drawn before it; stop strings still stop),
`skip_special_tokens`, `include_stop_str_in_output`, `truncate_prompt_tokens`, `prompt_logprobs` (in vLLM's
layout, not streamed), and in chat `chat_template_kwargs`
(the template's variables, such as Qwen3's enable_thinking) and `add_generation_prompt` are accepted too (a
request's own `chat_template` is refused). /v1/completions
takes a batch of prompts (a list of strings or of token id lists): prompt p's n choices have the indexes p * n to
p * n + n - 1, as OpenAI and vLLM number them. Its `echo` starts each choice's text with the prompt and, with
`logprobs`, its logprobs with the prompt tokens' (the first one's null, as OpenAI's legacy completions gave them);
`echo` with `max_tokens: 0` returns the prompt alone, which is how evaluation harnesses score a text.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..request import InvalidParameterError, SamplingParams
from ..structured import json_schema_grammar
from ..tokenizer import RESERVED_VARIABLES
from .structured_outputs import structured_outputs_grammar
from .fill_in_middle import fim_prompt
from .reasoning import ThinkingStream
from .tool_syntax import HeldCalls, StreamedCalls, ToolSyntax
from .tools import AutoCalls, ForcedCall, tool_calls, tool_use, with_call_tokens

MAX_LOGPROBS = 20
MAX_PROMPTS = 1024  # prompts in one /v1/completions batch
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
              "tool": "tool"}  # -> template role

# A token id's text and its bytes (the bytes of a byte-level token need not be valid UTF-8 on their own).
TokenPiece = Callable[[int], tuple[str, bytes]]


class APIError(Exception):
    """An error answered as OpenAI does: HTTP `status` and {"error": {"message", "type", "param", "code"}}."""

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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(message: str, param: str) -> APIError:
    return bad_request(message, param=param, code="unsupported_parameter")


@dataclass(frozen=True)
class GenerateRequest:
    """A validated /v1/chat/completions or /v1/completions request, ready for the engine."""

    chat: bool
    model: str | None  # None: the served model
    prompts: tuple[str | list[int] | list[dict], ...]  # completion texts or token ids; chat: one, its messages
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool = False  # and continuous_usage_stats (vLLM's): every chunk with the usage so far
    logprobs: bool = False  # return logprobs (params.logprobs holds how many alternatives)
    echo: bool = False  # completions: each choice's text (and logprobs) starts with its prompt's
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (the engine's one token is dropped)
    prompt_param: str = ""  # the field that holds the prompt, named in errors about it (default: prompt / messages)
    forced_call: ForcedCall | None = None  # chat: the tool call tool_choice forces (server/tools.py)
    auto_calls: AutoCalls | None = None  # chat, tool_choice "auto": the calls the model may write (server/tools.py)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each prompt's last this many tokens (-1: the context)
    template_kwargs: dict | None = None  # chat, vLLM's: the chat template's variables and add_generation_prompt
    split_reasoning: bool = False  # chat: the reply's <think> text goes to reasoning_content (reasoning.py)
    grammar_param: str | None = None  # the field whose grammar params.grammar is (named in the engine's refusals)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs: the prompt tokens' logprobs go in the answer

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools the chat template shows the model (forced or "auto" calls), else None."""
        calls = self.forced_call or self.auto_calls
        return list(calls.tools) if calls is not None else None


class Fields:
    """Typed reads of a request body's fields; a present field of the wrong type is a 400 that names it."""

    def __init__(self, body: dict):
        self.body = body

    def get(self, name: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:  # absent or null
            return default
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise bad_request(f"{name} must be {what}, got {json_type(value)}", param=name)
        return value

    def number(self, name: str, default: float) -> float:
        return float(self.get(name, (int, float), "a number", default))

    def integer(self, name: str, default: int | None = None) -> int | None:
        value = self.body.get(name)
        if isinstance(value, float) and value.is_integer() and abs(value) >= 2**63:
            # orjson reads an integer literal past 64 bits as a float: say so rather than "got a number"
            raise bad_request(f"{name} must fit in 64 bits", param=name)
        return self.get(name, (int,), "an integer", default)

    def boolean(self, name: str, default: bool = False) -> bool:
        return self.get(name, (bool,), "a boolean", default)

    def string(self, name: str) -> str | None:
        return self.get(name, (str,), "a string")

    def strings(self, name: str) -> tuple[str, ...]:
        value = self.get(name, (str, list), "a string or a list of strings", ())
        values = [value] if isinstance(value, str) else value
        if not all(isinstance(v, str) for v in values):
            raise bad_request(f"{name} must be a string or a list of strings", param=name)
        return tuple(values)

    def integers(self, name: str) -> tuple[int, ...]:
        values = self.get(name, (list,), "a list of integers", ())
        if not all(_is_int(v) for v in values):
            raise bad_request(f"{name} must be a list of integers", param=name)
        return tuple(values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)



def _reject_unsupported(fields: Fields, n: int, chat: bool) -> None:
    body = fields.body
    if chat and body.get("chat_template") is not None:
        raise unsupported("chat_template is not supported: requests use the model's own chat template",
                          "chat_template")
    # chat: tools and tool_choice are server/tools.py's; the legacy functions and function_call are refused
    pairs = (("functions", "function_call"),) if chat else (("tools", "tool_choice"), ("functions", "function_call"))
    for name, choice in pairs:
        if fields.get(name, (list,), "an array", ()) and body.get(choice) != "none":
            where = "in /v1/completions" if name == "tools" else "through the legacy functions"
            raise unsupported(f'tool calling is not supported {where} (with {choice}: "none" the {name} are '
                              f'ignored)', name)
    for _, name in pairs:  # function_call: the legacy form of tool_choice
        value = body.get(name)
        if value in (None, "none", "auto"):
            continue
        if not (isinstance(value, dict) or value == "required"):
            raise bad_request(f'{name} must be "none", "auto", "required" or an object naming a function, got '
                              f"{value!r}", param=name)
        raise unsupported(f"{name} is not supported by this server", name)
    if body.get("audio") or any(m != "text" for m in fields.strings("modalities")):
        raise unsupported("audio output is not supported; this model writes text only",
                          "audio" if body.get("audio") else "modalities")
    if fields.boolean("continue_final_message"):
        raise unsupported("continue_final_message is not supported: a last assistant message is answered in a new "
                          "turn", "continue_final_message")
    best_of = fields.integer("best_of")
    if best_of is not None and best_of < 1:
        raise bad_request("best_of must be a positive integer", param="best_of")
    if best_of is not None and best_of != n:
        raise unsupported(f"best_of ({best_of}) other than n ({n}) is not supported", "best_of")


def sampling_params(fields: Fields, max_tokens: int | None, max_tokens_name: str, logprobs: int | None,
                    n: int, grammar: str | None = None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=fields.number("temperature", 1.0),
            top_p=fields.number("top_p", 1.0),
            top_k=fields.integer("top_k", 0),
            min_p=fields.number("min_p", 0.0),
            seed=fields.integer("seed"),
            stop=fields.strings("stop"),
            stop_token_ids=fields.integers("stop_token_ids"),
            ignore_eos=fields.boolean("ignore_eos"),
            presence_penalty=fields.number("presence_penalty", 0.0),
            frequency_penalty=fields.number("frequency_penalty", 0.0),
            repetition_penalty=fields.number("repetition_penalty", 1.0),
            logit_bias=_logit_bias(fields),
            logprobs=logprobs,
            grammar=grammar,
            min_tokens=fields.integer("min_tokens", 0),
            prompt_logprobs=fields.integer("prompt_logprobs"),
            skip_special_tokens=fields.boolean("skip_special_tokens", True),
            include_stop_str_in_output=fields.boolean("include_stop_str_in_output"),
            n=n,
        )
    except InvalidParameterError as e:
        if e.param == "max_tokens" and max_tokens_name != "max_tokens":
            raise bad_request(str(e).replace("max_tokens", max_tokens_name, 1), param=max_tokens_name) from None
        raise bad_request(str(e), param=e.param) from None


def response_grammar(value: Any, param: str) -> str | None:
    """The grammar a response format asks for: None for text, else JSON (`json_object`: any object;
    `json_schema`: documents valid under its schema, given in `value["json_schema"]["schema"]` as chat and
    completions put it, or in `value["schema"]` as the Responses API does)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = value.get("json_schema", value)
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise bad_request(f"{param}: the json_schema's schema must be a JSON schema object", param=param)
    else:
        raise bad_request(f'{param} must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": '
                          f'"json_schema", ...}}, got {value!r:.80}', param=param)
    try:
        return json_schema_grammar(schema)
    except InvalidParameterError as error:
        raise bad_request(f"{param}: {error}", param=param) from None


def output_grammar(body: dict, response_format: Any, param: str = "response_format") -> tuple[str, str] | None:
    """(the field that asked, the grammar) the output must follow: the `response_format` value (in the field
    `param`), or vLLM's structured-output fields (structured_outputs.py); asking for both is a 400."""
    from_format = response_grammar(response_format, param)
    try:
        from_vllm = structured_outputs_grammar(body)
    except InvalidParameterError as e:
        raise bad_request(str(e), param=e.param) from None
    if from_format is not None and from_vllm is not None:
        raise bad_request(f"{param} and {from_vllm[0]} cannot be asked together", param=from_vllm[0])
    return (param, from_format) if from_format is not None else from_vllm


def _logit_bias(fields: Fields) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs: keys are token ids written as decimal strings ("50256"), no sign, no
    leading zero (so no two keys name one token), values are numbers; the ranges are SamplingParams' and the
    engine's."""
    bias = fields.get("logit_bias", (dict,), "an object mapping token ids to biases", {})
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) < 19 and str(int(key)) == key):
            raise bad_request(f'logit_bias keys must be token ids such as "50256", got {key[:24]!r}',
                              param="logit_bias")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad_request(f"logit_bias[{key!r}] must be a number, got {json_type(value)}", param="logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def _stream_options(fields: Fields, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats: vLLM's usage so far in every chunk) of stream_options."""
    options = fields.get("stream_options", (dict,), "an object")
    if options is None:
        return False, False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name, False)
        if not isinstance(value, bool) and value is not None:
            raise bad_request(f"stream_options.{name} must be a boolean", param=f"stream_options.{name}")
        flags.append(bool(value))
    return flags[0], flags[1]


def _common_options(fields: Fields, stream: bool) -> dict[str, Any]:
    """The GenerateRequest fields common to chat and completions: stream_options, truncate_prompt_tokens, whether
    vLLM's prompt_logprobs go in the answer (not streamed; their count is SamplingParams')."""
    include_usage, continuous = _stream_options(fields, stream)
    if fields.integer("prompt_logprobs") is not None and stream:
        raise bad_request("prompt_logprobs is not available when streaming", param="prompt_logprobs")
    truncate = fields.integer("truncate_prompt_tokens")
    if truncate is not None and truncate < 1 and truncate != -1:
        raise bad_request("truncate_prompt_tokens must be a positive integer or -1 (the model's context)",
                          param="truncate_prompt_tokens")
    return {"include_usage": include_usage, "continuous_usage": include_usage and continuous,
            "truncate_prompt_tokens": truncate, "prompt_logprobs": fields.integer("prompt_logprobs") is not None}


# Fields of the other endpoint that would change the result if they were ignored like unknown fields: a user
# who sends max_completion_tokens to /v1/completions would get 16 tokens, not the number asked for.
_OTHER_ENDPOINT = {
    False: {"messages": "messages belong to /v1/chat/completions; /v1/completions takes a prompt",
            "max_completion_tokens": "max_completion_tokens is a chat completions field; /v1/completions takes "
                                     "max_tokens",
            "top_logprobs": "top_logprobs is a chat completions field; /v1/completions takes logprobs: <count>"},
    True: {"prompt": "prompt belongs to /v1/completions; /v1/chat/completions takes messages"},
}


def _common(fields: Fields, chat: bool) -> tuple[str | None, bool, int]:
    for name, message in _OTHER_ENDPOINT[chat].items():
        if fields.body.get(name) is not None:
            raise bad_request(message, param=name)
    fields.string("user")  # accepted for compatibility; only its type is checked
    n = fields.integer("n", 1)
    _reject_unsupported(fields, n, chat)
    return fields.string("model"), fields.boolean("stream"), n


def parse_completion(body: Any, fim_tokens: tuple[str, str, str] | None = None) -> GenerateRequest:
    """Validate a /v1/completions body; `fim_tokens`: the model's fill-in-the-middle tokens, which `suffix` needs
    (fill_in_middle.py)."""
    fields = Fields(body_object(body))
    model, stream, n = _common(fields, chat=False)
    suffix = fields.string("suffix")
    logprobs = fields.integer("logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")
    max_tokens = fields.integer("max_tokens") if "max_tokens" in body else 16  # null: up to the context
    echo = fields.boolean("echo")
    echo_only = echo and max_tokens == 0  # scoring a text (its logprobs), as evaluation harnesses do
    asked = output_grammar(body, body.get("response_format"))
    params = sampling_params(fields, 1 if echo_only else max_tokens, "max_tokens", logprobs, n,
                             asked[1] if asked is not None else None)
    if echo and logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=max(logprobs, params.prompt_logprobs or 0))
    prompts = _prompts(body.get("prompt"))
    if suffix:
        if fim_tokens is None:
            raise unsupported("suffix needs a model trained to fill in the middle; this model's vocabulary has no "
                              "fill-in-the-middle tokens", "suffix")
        if echo or not all(isinstance(p, str) for p in prompts):
            raise bad_request("suffix takes text prompts without echo", param="suffix")
        prompts = tuple(fim_prompt(fim_tokens, prompt, suffix) for prompt in prompts)
    return GenerateRequest(
        chat=False, model=model, prompts=prompts, params=params,
        grammar_param=asked[0] if asked is not None else None,
        stream=stream, logprobs=logprobs is not None,
        echo=echo, echo_only=echo_only, **_common_options(fields, stream),
    )


def parse_chat(body: Any, tool_syntax: ToolSyntax | None = None, split_reasoning: bool = False
               ) -> GenerateRequest:
    """Validate a /v1/chat/completions body."""
    fields = Fields(body_object(body))
    model, stream, n = _common(fields, chat=True)
    if fields.boolean("echo"):
        raise unsupported("echo is not supported in chat completions (it is in /v1/completions)", "echo")
    logprobs = fields.boolean("logprobs")
    top_logprobs = fields.integer("top_logprobs")
    if top_logprobs is not None:
        if not logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        if not 0 <= top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", param="top_logprobs")
    max_tokens, name = fields.integer("max_completion_tokens"), "max_completion_tokens"
    legacy_max_tokens = fields.integer("max_tokens")
    if max_tokens is None:  # neither: up to the context
        max_tokens, name = legacy_max_tokens, "max_tokens"
    elif legacy_max_tokens is not None and legacy_max_tokens < 1:  # checked even when max_completion_tokens wins
        raise bad_request("max_tokens must be a positive integer", param="max_tokens")
    use = tool_use(fields.get("tools", (list,), "an array"), body.get("tool_choice"),
                   lambda message, param: bad_request(message, param=param),
                   fields.boolean("parallel_tool_calls", True), tool_syntax)
    call = use if isinstance(use, ForcedCall) else None
    asked = output_grammar(body, body.get("response_format"))
    if call is not None and asked is not None:
        raise bad_request(f"a forced tool call and {asked[0]} cannot be asked together", param=asked[0])
    grammar = asked[1] if asked is not None else None
    return GenerateRequest(
        chat=True, model=model, prompts=(chat_messages(body.get("messages")),),
        params=with_call_tokens(use, sampling_params(fields, max_tokens, name, (top_logprobs or 0) if logprobs
                                                     else None, n, call.grammar if call is not None else grammar)),
        stream=stream, logprobs=logprobs, forced_call=call, auto_calls=use if isinstance(use, AutoCalls) else None,
        template_kwargs=template_kwargs(fields), split_reasoning=split_reasoning and call is None,
        grammar_param="tools" if call is not None else asked[0] if asked is not None else None,
        **_common_options(fields, stream),
    )


def template_kwargs(fields: Fields) -> dict | None:
    """vLLM's chat_template_kwargs (variables the chat template reads, such as Qwen3's enable_thinking) and
    add_generation_prompt, as keyword arguments of the template."""
    kwargs = dict(fields.get("chat_template_kwargs", (dict,), "an object", {}))
    for key in kwargs:
        if not key.isidentifier() or key in RESERVED_VARIABLES:
            raise bad_request(f"chat_template_kwargs cannot set {key[:40]!r}: its keys are the template's variables, "
                              f"named as identifiers and none of the renderer's own ({', '.join(RESERVED_VARIABLES)}; "
                              f"send messages and tools as fields of their own)", param="chat_template_kwargs")
    add = fields.boolean("add_generation_prompt", kwargs.get("add_generation_prompt", True))
    if not isinstance(add, bool):
        raise bad_request("chat_template_kwargs.add_generation_prompt must be a boolean",
                          param="chat_template_kwargs")
    return dict(kwargs, add_generation_prompt=add) if kwargs or not add else None


def body_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {json_type(body)}")
    return body


def _prompts(prompt: Any) -> tuple[str | list[int], ...]:
    """A completions prompt: a string or a list of token ids, or a batch of them (a list of strings, or a list of
    token id lists)."""
    if prompt is None:
        raise bad_request("prompt is required", param="prompt")
    batch = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
        else [prompt]
    if len(batch) > MAX_PROMPTS:
        raise bad_request(f"a batch holds at most {MAX_PROMPTS} prompts, got {len(batch)}", param="prompt")
    if not (all(isinstance(p, str) for p in batch) or all(isinstance(p, list) and p and all(_is_int(t) for t in p)
                                                          for p in batch)):
        raise bad_request("prompt must be a string, a list of token ids, a list of strings or a list of token id "
                          "lists", param="prompt")
    if any(isinstance(p, list) and min(p) < 0 for p in batch):
        raise bad_request("prompt token ids must be non-negative", param="prompt")
    return tuple(batch)


REASONING_FIELDS = ("reasoning_content", "reasoning")  # where an assistant message may carry its reasoning


def chat_messages(messages: Any, name: str = "messages") -> list[dict]:
    """Chat messages as {"role", "content": str} dicts; content parts other than text are refused. `name`: the
    field that holds them, named in errors."""
    if messages is None:
        raise bad_request(f"{name} is required", param=name)
    if not isinstance(messages, list) or not messages:
        raise bad_request(f"{name} must be a non-empty array of message objects", param=name)
    out = []
    for i, message in enumerate(messages):
        param = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{param} must be an object, got {json_type(message)}", param=param)
        role = message.get("role")
        if role == "function" or message.get("function_call"):
            raise unsupported(f"{param}: the legacy function messages and function_call are not supported by this "
                              f"server (tool messages and tool_calls are)", param)
        if not isinstance(role, str) or role not in CHAT_ROLES:  # (a list or an object is not hashable)
            raise bad_request(f"{param}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                              param=f"{param}.role")
        if not isinstance(message.get("name", ""), (str, type(None))):  # read by no template; checked as OpenAI
            raise bad_request(f"{param}.name must be a string", param=f"{param}.name")
        entry = {"role": CHAT_ROLES[role], "content": _content(message.get("content"), role, f"{param}.content")}
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise bad_request(f"{param}.tool_call_id must be a string", param=f"{param}.tool_call_id")
            entry["tool_call_id"] = message["tool_call_id"]
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise bad_request(f"{param}: only assistant messages carry tool_calls", param=f"{param}.tool_calls")
            entry["tool_calls"] = _history_calls(message["tool_calls"], f"{param}.tool_calls")
        for key in REASONING_FIELDS:  # an earlier reply's reasoning, which thinking models' templates may show
            if message.get(key) is not None:
                if role != "assistant" or not isinstance(message[key], str):
                    raise bad_request(f"{param}.{key} must be a string, in an assistant message", f"{param}.{key}")
                entry["reasoning_content"] = message[key]
        out.append(entry)
    return out


def _history_calls(calls: Any, param: str) -> list[dict]:
    """An assistant message's earlier tool_calls as chat templates take them: the arguments as an object."""
    if not isinstance(calls, list):
        raise bad_request(f"{param} must be an array", param=param)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise bad_request(f'{param}[{j}] must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                              f'"arguments": "<JSON>"}}}}', param=f"{param}[{j}]")
        try:
            parsed = json.loads(arguments)
        except ValueError:  # not JSON, or a number past Python's 4300 digits
            raise bad_request(f"{param}[{j}].function.arguments must be a JSON text",
                              param=f"{param}[{j}].function.arguments") from None
        out.append({"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": parsed}})
    return out


def _content(content: Any, role: str, param: str) -> str:
    if content is None and role == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or an array of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])  # OpenAI's assistant parts are text or refusal: a replayed history
        elif isinstance(kind, str) and kind != "text":
            raise unsupported(f"{param}[{j}]: content of type {kind!r} is not supported; this model reads text only",
                              f"{param}[{j}]")
        else:
            raise bad_request(f'{param}[{j}] must be {{"type": "text", "text": "..."}}', param=f"{param}[{j}]")
    return "\n".join(texts)


@dataclass
class _Choice:
    """What one of the request's n sequences has produced so far."""

    index: int
    # Non-streaming only: the text deltas and logprobs, for the final body.
    texts: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # chat: content entries
    tokens: list[str] = field(default_factory=list)  # completions: parallel lists
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    offset: int = 0  # completions: characters of token text so far
    completion_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    echoed: bool = False  # echo: the prompt went out (with the choice's first output)
    tool_calls: list[dict] | None = None  # the calls its whole text makes (set once finished)
    content: str | None = None  # tool_choice "auto": the text before those calls
    thinking: ThinkingStream | None = None  # with split_reasoning: the reply split into reasoning and content
    prompt_logprobs: list | None = None  # with prompt_logprobs: vLLM's list for the prompt (None first)
    calls_read: StreamedCalls | HeldCalls | None = None  # tool_choice "auto", streaming: its text's calls so far


class Responder:
    """Turns one request's RequestOutputs into OpenAI response bodies: stream chunks or the whole completion."""

    def __init__(self, request: GenerateRequest, model: str, token_piece: TokenPiece,
                 decode: Callable[[list[int]], str]):
        self.request = request
        self._decode = decode  # token ids -> text: the echo of a prompt given as token ids
        self.model = model
        self.id = ("chatcmpl-" if request.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if request.chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if request.chat else "text_completion"
        # Per prompt: its tokens, and those its sequence 0 took from the prefix cache (its n sequences share one
        # prompt, counted once).
        self._prompt_tokens = [0] * len(request.prompts)
        self._cached_tokens = [0] * len(request.prompts)
        self._token_piece = token_piece
        self._choices = [_Choice(i) for i in range(len(request.prompts) * request.params.n)]
        self.thinking_started = False  # with split_reasoning: the prompt leaves the reply inside the thinking tag

    def _body(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def add(self, output: Any, prompt_index: int = 0) -> dict:
        """Record one RequestOutput of the prompt `prompt_index`; returns its choice as a stream chunk's `choices`
        entry."""
        choice = self._choices[prompt_index * self.request.params.n + output.index]
        self._prompt_tokens[prompt_index] = output.prompt_tokens
        if output.index == 0:
            self._cached_tokens[prompt_index] = output.cached_tokens
        request = self.request
        echo = request.echo and not choice.echoed
        text, entries = ("", None) if request.echo_only else (output.text, output.logprobs)
        choice.completion_tokens = 0 if request.echo_only else output.completion_tokens
        choice.finish_reason = output.finish_reason
        choice.stop_reason = output.stop_reason
        if echo:  # the prompt first: its text, its tokens' logprobs (the first token's null)
            choice.echoed = True
            prompt = request.prompts[prompt_index]
            text = (prompt if isinstance(prompt, str) else self._decode(list(prompt))) + text
            if output.prompt_token_ids:
                first = output.prompt_token_ids[0]
                entries = [(first, None, None), *(output.prompt_logprobs or ()), *(entries or ())]
        if request.prompt_logprobs and output.prompt_token_ids and choice.prompt_logprobs is None:
            choice.prompt_logprobs = [None, *(self._vllm_logprobs(entry) for entry in output.prompt_logprobs or ())]
        call = request.forced_call
        reasoning = ""
        if request.split_reasoning:  # from here on `text` is the content alone
            choice.thinking = choice.thinking or ThinkingStream(self.thinking_started)
            reasoning, text = choice.thinking.feed(text, len(output.token_ids))
            if output.finished:
                reasoning, text = (a + b for a, b in zip((reasoning, text), choice.thinking.finish()))
        if not request.stream or call is not None:  # a forced call's text is its calls: parsed once whole
            choice.texts.append(text)
        logprobs = self._logprobs(choice, entries) if request.logprobs else None
        entry: dict[str, Any] = {"index": choice.index}
        if call is not None:
            entry["delta"] = {}
            if output.finished:
                choice.tool_calls = tool_calls(call, "".join(choice.texts))
                if choice.tool_calls is not None:
                    choice.finish_reason = "tool_calls"
                    entry["delta"] = {"tool_calls": [dict(c, index=i) for i, c in enumerate(choice.tool_calls)]}
                else:  # cut by max_tokens: the text as it is
                    entry["delta"] = {"content": "".join(choice.texts)}
        elif request.auto_calls is not None:
            entry["delta"] = self._auto_delta(choice, request.auto_calls, text, output.finished)
        elif request.chat:
            entry["delta"] = {"content": text} if text or not output.finished else {}
        else:
            entry["text"] = text
        if reasoning:  # (no empty content beside it)
            entry["delta"] = {"reasoning_content": reasoning, **{k: v for k, v in entry["delta"].items() if v}}
        entry["logprobs"] = logprobs
        entry["finish_reason"] = choice.finish_reason
        if output.finished:
            entry["stop_reason"] = output.stop_reason
        return entry

    def _auto_delta(self, choice: _Choice, auto: AutoCalls, text: str, finished: bool) -> dict:
        """tool_choice "auto": the delta of one output's `text`. Streaming: the content and the calls' pieces the
        syntax's reader lets out now (tool_syntax.py); not streaming, nothing: once the text is whole, the calls it
        makes, if it makes any (finish_reason "tool_calls"), are read from it whole."""
        if not self.request.stream:
            split = auto.syntax.split("".join(choice.texts), auto.schemas) if finished else None
            if split is not None:
                before, choice.tool_calls = split
                choice.content = before if before.strip() else None
                choice.finish_reason = "tool_calls"
            return {}
        choice.calls_read = choice.calls_read or auto.syntax.stream_reader(auto.schemas)
        content, calls = choice.calls_read.feed(text)
        if finished:
            rest, more_calls = choice.calls_read.finish()
            content, calls = content + rest, calls + more_calls
            if choice.calls_read.calls and choice.calls_read.whole:
                choice.finish_reason = "tool_calls"
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _logprobs(self, choice: _Choice, entries: list | None) -> dict:
        """This delta's logprobs in the endpoint's format; kept in the choice too when not streaming."""
        keep = not self.request.stream
        if self.request.chat:
            content = [dict(self._chat_logprob(token_id, logprob),
                            top_logprobs=[self._chat_logprob(t, lp) for t, lp in top])
                       for token_id, logprob, top in entries or ()]
            if keep:
                choice.logprobs += content
            return {"content": content}
        delta: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, logprob, top in entries or ():
            text = self._token_piece(token_id)[0]
            delta["tokens"].append(text)
            if logprob is None:  # an echoed prompt's first token: nothing before it to predict it
                delta["token_logprobs"].append(None)
                delta["top_logprobs"].append(None)
            else:
                delta["token_logprobs"].append(max(logprob, MIN_LOGPROB))
                alternatives: dict[str, float] = {}
                for t, lp in top:  # best first: a text two tokens share keeps the better logprob
                    alternatives.setdefault(self._token_piece(t)[0], max(lp, MIN_LOGPROB))
                alternatives.setdefault(text, max(logprob, MIN_LOGPROB))  # as OpenAI: the sampled token's too
                delta["top_logprobs"].append(alternatives)
            delta["text_offset"].append(choice.offset)
            choice.offset += len(text)
        if keep:
            choice.tokens += delta["tokens"]
            choice.token_logprobs += delta["token_logprobs"]
            choice.top_logprobs += delta["top_logprobs"]
            choice.text_offset += delta["text_offset"]
        return delta

    def _vllm_logprobs(self, entry: tuple) -> dict:
        """One prompt position as vLLM's prompt_logprobs give it: token id (a string) -> its logprob, its rank (1:
        the most likely; null for the prompt's token where it is not among the top ones) and its text."""
        token_id, logprob, top = entry
        ranked = {t: (lp, rank) for rank, (t, lp) in enumerate(top, start=1)}
        out = {str(token_id): {"logprob": max(logprob, MIN_LOGPROB), "rank": ranked.get(token_id, (None, None))[1],
                               "decoded_token": self._token_piece(token_id)[0]}}
        for t, (lp, rank) in ranked.items():
            out.setdefault(str(t), {"logprob": max(lp, MIN_LOGPROB), "rank": rank,
                                    "decoded_token": self._token_piece(t)[0]})
        return out

    def _chat_logprob(self, token_id: int, logprob: float) -> dict:
        text, raw = self._token_piece(token_id)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(raw)}

    def usage(self) -> dict:
        prompt, completion = sum(self._prompt_tokens), sum(c.completion_tokens for c in self._choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": sum(self._cached_tokens)}}
        if self.request.split_reasoning:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(c.thinking.reasoning_tokens for c in
                                                                          self._choices if c.thinking is not None)}
        return usage

    def admitted(self, prompt_tokens: list[int]) -> None:
        """The prompts' token counts, known once the engine has admitted them (before any output)."""
        self._prompt_tokens = list(prompt_tokens)

    def opening(self) -> list[dict]:
        """A stream's first chunks: chat streams open with one per choice that carries the assistant role."""
        return self.role_chunks() if self.request.chat else []

    def events(self, output: Any, prompt_index: int = 0) -> list[dict]:
        """Record one RequestOutput; the stream chunk it makes (none for an output with nothing to show yet)."""
        choice = self.add(output, prompt_index)
        if self.request.chat and output.finished and choice["delta"].get("tool_calls"):
            # The calls, then the end in a chunk of its own, as OpenAI sends them: the SDK's stream helper closes
            # a call's arguments (its arguments.done event) when the end arrives after the call.
            end = {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"],
                   "stop_reason": choice.get("stop_reason")}
            calls = {key: value for key, value in choice.items() if key != "stop_reason"}
            return [self.chunk(dict(calls, finish_reason=None)), self.chunk(end)]
        if self.request.forced_call is not None:  # the calls go out whole, at the end
            return [self.chunk(choice)] if output.finished else []
        text = any(choice["delta"].values()) if self.request.chat else choice.get("text")
        shown = text or output.finished or (self.request.logprobs and output.logprobs)
        return [self.chunk(choice)] if shown else []

    def closing(self) -> list[dict]:
        """A stream's last chunks: the usage, when stream_options asked for it."""
        return [self.usage_chunk()] if self.request.include_usage else []

    def chunk(self, choice: dict) -> dict:
        """A stream chunk holding one choice's delta."""
        body = self._body(self.chunk_object, [choice])
        if self.request.include_usage:
            body["usage"] = self.usage() if self.request.continuous_usage else None
        return body

    def role_chunks(self) -> list[dict]:
        """Chat streams open with one chunk per choice that carries the assistant role."""
        return [self.chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}) for c in self._choices]

    def usage_chunk(self) -> dict:
        return dict(self._body(self.chunk_object, []), usage=self.usage())

    def response(self) -> dict:
        """The non-streaming body, once every choice has finished."""
        choices = []
        for c in self._choices:
            entry: dict[str, Any] = {"index": c.index}
            if self.request.chat:
                entry["message"] = ({"role": "assistant", "content": c.content, "tool_calls": c.tool_calls}
                                    if c.tool_calls is not None else {"role": "assistant", "content": "".join(c.texts)})
                if c.thinking is not None and c.thinking.thought:
                    entry["message"]["reasoning_content"] = "".join(c.thinking.reasoning)
                entry["logprobs"] = {"content": c.logprobs} if self.request.logprobs else None
            else:
                entry["text"] = "".join(c.texts)
                entry["logprobs"] = ({"tokens": c.tokens, "token_logprobs": c.token_logprobs,
                                      "top_logprobs": c.top_logprobs, "text_offset": c.text_offset}
                                     if self.request.logprobs else None)
            entry["finish_reason"] = c.finish_reason
            entry["stop_reason"] = c.stop_reason
            if self.request.prompt_logprobs and not self.request.chat:
                entry["prompt_logprobs"] = c.prompt_logprobs
            choices.append(entry)
        body = dict(self._body(self.object, choices), usage=self.usage())
        if self.request.prompt_logprobs and self.request.chat:  # vLLM's chat answer holds them once, at the top
            body["prompt_logprobs"] = self._choices[0].prompt_logprobs
        return body
