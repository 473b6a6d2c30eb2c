"""A tool call's parts as the syntaxes write them (tool_syntax.py reads whole texts, tool_streams.py streamed ones):
the tool_calls entry of a call, and raw parameter values, as the XML-like syntaxes write them (Qwen3-Coder,
GLM-4.5, MiniMax-M2), typed by the tool's parameters schema as vLLM's parsers type them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from .json_depth import json_text


def tool_call_entry(call: object, tools: Mapping[str, Any]) -> dict | None:
    """A tool_calls entry from a decoded {"name", "arguments"} object; None if it is not a call of `tools`."""
    if not isinstance(call, dict) or call.get("name") not in tools:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def json_call(text: str, tools: Mapping[str, Any]) -> dict | None:
    """A tool_calls entry from the text of a JSON {"name", "arguments"} object; None if it is not a call of
    `tools`."""
    try:
        call = json_text(text)
    except ValueError:
        return None
    return tool_call_entry(call, tools)


def typed_arguments(pairs: list[tuple[str, str]], schema: Any) -> dict:
    """Raw (key, value) pairs as arguments, each value typed by its parameter's schema in `schema`
    (`typed_value`)."""
    return {key: typed_value(value, parameter_schema(schema, key)) for key, value in pairs}


def parameter_schema(schema: Any, key: str) -> Any:
    """The schema of parameter `key` in a tool's parameters schema (None where it has none)."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return properties.get(key) if isinstance(properties, dict) else None


def typed_value(value: str, schema: Any) -> Any:
    """A raw parameter value as its schema's type asks (the string where it does not read as that type)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if not any(k in ("integer", "number", "boolean", "null", "object", "array") for k in kinds):
        return value
    try:
        typed = json_text(value)
    except ValueError:
        return value
    matches = {"integer": isinstance(typed, int) and not isinstance(typed, bool),
               "number": isinstance(typed, (int, float)) and not isinstance(typed, bool),
               "boolean": isinstance(typed, bool), "null": typed is None, "object": isinstance(typed, dict),
               "array": isinstance(typed, list)}
    return typed if any(matches.get(k, False) for k in kinds) else value
