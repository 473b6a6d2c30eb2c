"""Function calling in chat completions: a call the request forces (tool_choice "required" or a named function), or
calls the model may make in its own syntax (tool_choice "auto", the default with tools; tool_syntax.py).

The call is written under a grammar (../structured.py): for a named function, JSON arguments valid under its
`parameters` schema; for "required", a JSON array of one or more {"name", "parameters"} objects, each valid under
its tool's schema (as vLLM forces calls). The tools also go to the chat template, so the model sees them the way its
template shows tools. The text becomes the message's `tool_calls` (finish_reason "tool_calls"); a call cut by
max_tokens stays text (finish_reason "length"); with parallel_tool_calls false "required" makes one call, and of
the calls "auto" reads only the first is kept.
With tool_choice "auto" the model writes freely, shown the tools by its template, and the calls
it writes in the syntax its template teaches become tool_calls; a model whose template teaches none this server
reads is shown the tools all the same and answers in text, as OpenAI answers "auto" (forcing a call still works).
History may hold assistant messages with tool_calls and tool messages with their results (chat_messages.chat_messages
passes them to the template).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidParameterError
from ..request import SamplingParams
from ..structured import json_schema_grammar
from .harmony import HarmonyToolSyntax
from .json_depth import json_text
from .tool_syntax import NO_TOOL_SYNTAX, ToolSyntax

ANY_OBJECT = {"type": "object"}  # the parameters of a function that declares none
MAX_NAME_CHARS = 64  # a function name's length, as OpenAI bounds it


@dataclass(frozen=True)
class ForcedCall:
    """What a request's tool_choice forces: `named` (that function's arguments) or, when None, one or more calls
    of any of `schemas` (name -> parameters schema); `tools` as the chat template takes them; the grammar."""

    named: str | None
    schemas: dict[str, Any]
    tools: tuple[dict, ...]
    grammar: str


@dataclass(frozen=True)
class AutoCalls:
    """tool_choice "auto": the model may call any of the functions of `schemas` (name -> parameters schema), in
    `syntax` (NO_TOOL_SYNTAX where its template teaches none: then it answers in text); `tools` as the chat
    template takes them. Not `parallel` (parallel_tool_calls false): only its first call is kept, as vLLM does."""

    schemas: dict[str, Any]
    tools: tuple[dict, ...]
    syntax: ToolSyntax
    parallel: bool = True


def with_call_tokens(use: ForcedCall | AutoCalls | None, params: SamplingParams,
                     syntax: ToolSyntax | HarmonyToolSyntax | None = None) -> SamplingParams:
    """`params`, keeping special tokens in the text where "auto" calls open with one (Mistral's [TOOL_CALLS]), and
    in every reply of a harmony model (`syntax`, the model's: its channels are special tokens)."""
    if (isinstance(use, AutoCalls) and use.syntax.keeps_special_tokens) or isinstance(syntax, HarmonyToolSyntax):
        return dataclasses.replace(params, skip_special_tokens=False)
    return params


def function_tools(tools: list, error) -> tuple[dict[str, Any], list[dict]]:
    """(name -> parameters schema, the tools as the chat template takes them) of a tools array, each checked;
    `error(message, param)` builds the 400 of a bad one to raise."""
    schemas, listed = {}, []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise error(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                        f"tools[{i}]")
        if len(name) > MAX_NAME_CHARS or any(c.isspace() or not c.isprintable() for c in name):
            raise error(f"tools[{i}].function.name must be 1 to {MAX_NAME_CHARS} characters without spaces or "
                        f"control characters, got {name!r:.80}", f"tools[{i}].function.name")
        for key, kind, words in (("description", str, "a string"), ("strict", bool, "a boolean")):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise error(f"tools[{i}].function.{key} must be {words}", f"tools[{i}].function.{key}")
        if name in schemas:
            raise error(f"tools[{i}]: the function name {name!r} is used twice", f"tools[{i}]")
        parameters = function.get("parameters", ANY_OBJECT)
        if not isinstance(parameters, dict):
            raise error(f"tools[{i}].function.parameters must be a JSON schema object",
                        f"tools[{i}].function.parameters")
        schemas[name] = parameters
        listed.append({"type": "function", "function": {key: function[key] for key in
                                                         ("name", "description", "parameters") if key in function}})
    return schemas, listed


def tool_use(tools: Any, tool_choice: Any, error, parallel: bool = True,
             syntax: ToolSyntax | None = None) -> ForcedCall | AutoCalls | None:
    """What `tool_choice` asks of `tools` (a chat body's fields): the call it forces, calls the model may make in
    `syntax` ("auto", the default with tools; a text answer where `syntax` is None), or None ("none", or no
    tools). "required"
    allows several calls unless `parallel` (parallel_tool_calls) is false. `error(message, param)` builds the 400
    of a bad value to raise."""
    if tool_choice not in (None, "none", "auto", "required") and not isinstance(tool_choice, dict):
        raise error(f'tool_choice must be "none", "auto", "required" or an object naming a function, got '
                    f'{tool_choice!r:.80}', "tool_choice")
    if tool_choice == "none" or (tool_choice is None and not tools):
        return None
    if not isinstance(tools, list) or not tools:
        raise error(f"tool_choice {tool_choice!r} needs a non-empty tools array", "tools")
    schemas, listed = function_tools(tools, error)
    if tool_choice in (None, "auto"):
        return AutoCalls(schemas, tuple(listed), syntax or NO_TOOL_SYNTAX, parallel)
    if tool_choice == "required":
        named, schema = None, {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, parameters in schemas.items()]}}
        if not parallel:
            schema["maxItems"] = 1
    else:
        function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        named = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(named, str) or named not in schemas:
            raise error(f'tool_choice must be "none", "required" or {{"type": "function", "function": {{"name": '
                        f'<one of {sorted(schemas)}>}}}}, got {tool_choice!r:.120}', "tool_choice")
        schema = schemas[named]
    try:
        grammar = json_schema_grammar(schema)
    except InvalidParameterError as e:
        raise error(f"tools: {e}", "tools") from None
    return ForcedCall(named, schemas, tuple(listed), grammar)


def tool_calls(call: ForcedCall, text: str) -> list[dict] | None:
    """The message's tool_calls from the text written under `call`'s grammar; None if it is not a whole document
    (cut by max_tokens)."""
    try:
        document = json_text(text)
    except ValueError:  # cut by max_tokens (or a number past Python's 4300 digits)
        return None
    pairs = [(call.named, document)] if call.named is not None else [(c["name"], c["parameters"]) for c in document]
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
            for name, arguments in pairs]
