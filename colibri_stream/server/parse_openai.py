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
from typing import Any

from .chat_messages import chat_messages
from .fields import Fields, bad_request, body_object, is_int, unsupported
from .fill_in_middle import fim_prompt
from .generate_request import GenerateRequest
from .harmony import HarmonyToolSyntax
from .params import generation_grammar, output_grammar, sampling_params, template_kwargs
from .tool_syntax import ToolSyntax
from .tools import AutoCalls, ForcedCall, tool_use, with_call_tokens

MAX_LOGPROBS = 20
MAX_PROMPTS = 1024  # prompts in one /v1/completions batch


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
    grammar, grammar_param = generation_grammar(None, output_grammar(body, body.get("response_format")))
    params = sampling_params(fields, 1 if echo_only else max_tokens, "max_tokens", logprobs, n, grammar)
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
        grammar_param=grammar_param, stream=stream, logprobs=logprobs is not None,
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
    use = tool_use(fields.get("tools", (list,), "an array"), body.get("tool_choice"), bad_request,
                   fields.boolean("parallel_tool_calls", True), tool_syntax)
    call = use if isinstance(use, ForcedCall) else None
    asked = output_grammar(body, body.get("response_format"))
    grammar, grammar_param = generation_grammar(call, asked)
    return GenerateRequest(
        chat=True, model=model, prompts=(chat_messages(body.get("messages")),),
        params=with_call_tokens(use, sampling_params(fields, max_tokens, name, (top_logprobs or 0) if logprobs
                                                     else None, n, grammar), tool_syntax),
        stream=stream, logprobs=logprobs, forced_call=call, auto_calls=use if isinstance(use, AutoCalls) else None,
        template_kwargs=template_kwargs(fields), split_reasoning=split_reasoning and call is None,
        harmony=isinstance(tool_syntax, HarmonyToolSyntax),
        grammar_param=grammar_param,
        **_common_options(fields, stream),
    )


def _prompts(prompt: Any) -> tuple[str | list[int], ...]:
    """A completions prompt: a string or a list of token ids, or a batch of them (a list of strings, or a list of
    token id lists)."""
    if prompt is None:
        raise bad_request("prompt is required", param="prompt")
    batch = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
        else [prompt]
    if len(batch) > MAX_PROMPTS:
        raise bad_request(f"a batch holds at most {MAX_PROMPTS} prompts, got {len(batch)}", param="prompt")
    if not (all(isinstance(p, str) for p in batch) or all(isinstance(p, list) and p and all(is_int(t) for t in p)
                                                          for p in batch)):
        raise bad_request("prompt must be a string, a list of token ids, a list of strings or a list of token id "
                          "lists", param="prompt")
    if any(isinstance(p, list) and min(p) < 0 for p in batch):
        raise bad_request("prompt token ids must be non-negative", param="prompt")
    return tuple(batch)
