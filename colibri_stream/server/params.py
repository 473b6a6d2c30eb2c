"""Request fields every API reads alike: the sampling parameters, the grammar a response format asks for, the
chat template's variables."""

from __future__ import annotations

import re
from typing import Any

from ..errors import InvalidParameterError
from ..request import SamplingParams
from ..structured import json_schema_grammar
from ..tokenizer import RESERVED_VARIABLES
from .fields import Fields, bad_request, json_type
from .structured_outputs import structured_outputs_grammar
from .tools import ForcedCall


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


# Where each API puts a json_schema format's fields: "chat" (chat and completions: {"type": "json_schema",
# "json_schema": {"name", "schema", "strict", "description"}}, the schema optional), "responses" (text.format:
# {"type": "json_schema", "name", "schema", ...}, both required), "anthropic" (output_config.format: {"type":
# "json_schema", "schema"}, no name).
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a response format's name


def response_grammar(value: Any, param: str, layout: str = "chat") -> str | None:
    """The grammar a response format asks for: None for text, else JSON (`json_object`: any object;
    `json_schema`: documents valid under its schema, its fields where `layout` ("chat", "responses" or
    "anthropic", as the comment above says) puts them, checked as OpenAI and Anthropic check them)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        schema = _json_schema_format(value, param, layout)
    else:
        raise bad_request(f'{param} must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": '
                          f'"json_schema", ...}}, got {value!r:.80}', param=param)
    try:
        return json_schema_grammar(schema)
    except InvalidParameterError as error:
        raise bad_request(f"{param}: {error}", param=param) from None


def _json_schema_format(value: dict, param: str, layout: str) -> Any:
    """The schema of a json_schema format, its other fields checked (a 400 naming the field that is wrong)."""
    if layout == "chat":
        spec, where = value.get("json_schema"), f"{param}.json_schema"
        if not isinstance(spec, dict):
            raise bad_request(f'{where} must be an object with the schema\'s "name" and its "schema", got '
                              f"{json_type(spec)}", param=where)
    else:
        spec, where = value, param
    if layout != "anthropic":
        name = spec.get("name")
        if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
            raise bad_request(f"{where}.name must be a string of 1 to 64 letters, digits, underscores or dashes, "
                              f"got {name!r:.80}", param=f"{where}.name")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise bad_request(f"{where}.strict must be a boolean, got {json_type(spec['strict'])}",
                              param=f"{where}.strict")
        if spec.get("description") is not None and not isinstance(spec["description"], str):
            raise bad_request(f"{where}.description must be a string, got {json_type(spec['description'])}",
                              param=f"{where}.description")
    if "schema" not in spec and layout != "chat":
        raise bad_request(f"{where}.schema is required: the JSON schema of the output", param=f"{where}.schema")
    schema = spec.get("schema", {})  # chat's schema is optional: any JSON document
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{where}.schema must be a JSON schema object, got {json_type(schema)}",
                          param=f"{where}.schema")
    return schema


def output_grammar(body: dict, response_format: Any, param: str = "response_format",
                   layout: str = "chat") -> tuple[str, str] | None:
    """(the field that asked, the grammar) the output must follow: the `response_format` value (in the field
    `param`, laid out as `layout` says: response_grammar), or vLLM's structured-output fields
    (structured_outputs.py); asking for both is a 400."""
    from_format = response_grammar(response_format, param, layout)
    try:
        from_vllm = structured_outputs_grammar(body)
    except InvalidParameterError as e:
        raise bad_request(str(e), param=e.param) from None
    if from_format is not None and from_vllm is not None:
        raise bad_request(f"{param} and {from_vllm[0]} cannot be asked together", param=from_vllm[0])
    return (param, from_format) if from_format is not None else from_vllm


def generation_grammar(call: ForcedCall | None, asked: tuple[str, str] | None) -> tuple[str | None, str | None]:
    """(the grammar the reply is written under, the field that asked for it): a forced tool call's (its tools'
    schemas), else what `asked` (output_grammar's, checked all the same) holds. A forced call's reply is the call
    alone, with no text for an output format to shape, so where both are asked the call's grammar is the one: OpenAI
    answers such a request with the call, vLLM writes it under the tool's schema, and agent frameworks send both (an
    agent with an output type whose tool_choice is "required")."""
    if call is not None:
        return call.grammar, "tools"
    return (asked[1], asked[0]) if asked is not None else (None, None)


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


REASONING_EFFORTS = ("minimal", "low", "medium", "high")  # the OpenAI API's reasoning efforts


def reasoning_effort(value: object, param: str) -> str | None:
    """A request's reasoning effort (chat's reasoning_effort, Responses' reasoning.effort), checked; None: not
    asked. It reaches the chat template as its variable `reasoning_effort`, as vLLM passes it: gpt-oss's template
    writes it into the system message, templates that do not read it ignore it."""
    if value is None or value in REASONING_EFFORTS:
        return value
    raise bad_request(f"{param} must be one of {', '.join(REASONING_EFFORTS)}, got {value!r:.40}", param=param)


def with_reasoning_effort(kwargs: dict | None, effort: str | None) -> dict | None:
    """Template keyword arguments `kwargs` (None: none) with the reasoning effort added, unless the request's
    chat_template_kwargs set the variable itself."""
    if effort is None:
        return kwargs
    return {"reasoning_effort": effort, "add_generation_prompt": True, **(kwargs or {})}


def template_kwargs(fields: Fields) -> dict | None:
    """vLLM's chat_template_kwargs (variables the chat template reads, such as Qwen3's enable_thinking) and
    add_generation_prompt, as keyword arguments of the template; chat's reasoning_effort as the variable of that
    name (`with_reasoning_effort`)."""
    effort = reasoning_effort(fields.body.get("reasoning_effort"), "reasoning_effort")
    return with_reasoning_effort(_template_kwargs(fields), effort)


def _template_kwargs(fields: Fields) -> dict | None:
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
