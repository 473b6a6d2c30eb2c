"""Chat messages as the chat template takes them, from the messages of a request (chat's, and those the Responses
and Messages APIs build from their own fields)."""

from __future__ import annotations

from typing import Any

from .fields import bad_request, json_type, unsupported
from .json_depth import json_text

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
              "tool": "tool"}  # -> template role
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
            _check_answers_a_call(out, message["tool_call_id"], param)
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


def _check_answers_a_call(earlier: list[dict], call_id: str, param: str) -> None:
    """A tool message answers a tool call of an earlier assistant message: OpenAI refuses one that answers none
    (a call without an id can be answered by any)."""
    calls = [call for message in earlier for call in message.get("tool_calls") or ()]
    if not calls:
        raise bad_request(f"{param}: a tool message must answer a tool call of an earlier assistant message, and "
                          "none has tool_calls", param=f"{param}.role")
    ids = [call["id"] for call in calls if isinstance(call.get("id"), str)]
    if len(ids) == len(calls) and call_id not in ids:
        raise bad_request(f"{param}.tool_call_id {call_id!r:.80} answers none of the earlier tool calls "
                          f"({', '.join(map(repr, ids))[:200]})", param=f"{param}.tool_call_id")


def _history_calls(calls: Any, param: str) -> list[dict]:
    """An assistant message's earlier tool_calls as chat templates take them: the arguments as an object."""
    if not isinstance(calls, list):
        raise bad_request(f"{param} must be an array", param=param)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name or not isinstance(arguments, str) \
                or not isinstance(call.get("id", ""), str) or call.get("type", "function") != "function":
            raise bad_request(f'{param}[{j}] must be {{"id": "<string>", "type": "function", "function": {{"name": '
                              f'"<name>", "arguments": "<JSON>"}}}}', param=f"{param}[{j}]")
        try:
            parsed = json_text(arguments)
        except ValueError as e:  # not JSON, nested too deep, or a number past Python's 4300 digits
            raise bad_request(f"{param}[{j}].function.arguments must be a JSON text: {e}",
                              param=f"{param}[{j}].function.arguments") from None
        out.append({"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": parsed}})
    return out


def _content(content: Any, role: str, param: str) -> str:
    if content is None and role == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or (not content and role != "assistant"):
        raise bad_request(f"{param} must be a string or a non-empty array of text parts", param=param)
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
