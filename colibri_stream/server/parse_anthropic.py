"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), for clients written against
the `anthropic` SDK, over the same engine requests as chat completions.

`system` (a string or text blocks) and `messages` (user and assistant turns whose content is a string or blocks:
text, tool_use, tool_result (its text after "Error: " where `is_error`), an earlier reply's thinking) become chat
messages under the model's template; `max_tokens` (required, as Anthropic), `temperature`, `top_p`, `top_k` and
`stop_sequences` are the sampling;
`tools` ({name, description, input_schema}) and `tool_choice` ({"type": "auto" | "any" | "tool" | "none"}) are
chat's tools and tool_choice ("auto", "required", a named function, "none"; server/tools.py, tool_syntax.py);
`thinking` ({"type": "enabled", "budget_tokens"} | {"type": "adaptive"} | {"type": "disabled"}) sets the
template's `enable_thinking` where the template reads that variable (Qwen3), and the reply's <think> text comes
back as a thinking block (server/reasoning.py); the budget is checked (a positive integer below max_tokens) but
not enforced: thinking and answer share max_tokens. `output_config.format` ({"type": "json_schema", "schema"})
constrains the text as chat's response_format does. `metadata` is accepted and changes nothing; the vLLM
extensions chat reads (`structured_outputs`, `seed`, `min_p`, ...) are read here too. A 400 as Anthropic answers
it: a temperature outside [0, 1], a message with empty content (but a final assistant one), an empty text block, a
tool_result whose tool_use_id names no tool_use of the assistant turn before it. What this server does not do is a
400 rather than something silently dropped: images and documents, server tools, a last assistant message
(prefill), thinking with a forced tool call (as Anthropic), `display: "omitted"`, `output_config.effort`, a
`thread` (a conversation the server would hold: refused with details.error_code "thread_unsupported_request", on
which the SDK's message threads and tool runner send the whole conversation instead).
Errors on these routes are Anthropic's {"type": "error", "error": {"type", "message"}} (render_anthropic.py); the
key may come as `x-api-key` (app.py). The replies and their stream are render_anthropic.py's.
"""

from __future__ import annotations

import json
from itertools import groupby
from typing import Any

from ..errors import APIError
from .chat_messages import chat_messages
from .fields import Fields, bad_request, body_object, json_type, unsupported
from .generate_request import GenerateRequest
from .harmony import HarmonyToolSyntax
from .params import generation_grammar, output_grammar, sampling_params
from .render_anthropic import THREAD_UNSUPPORTED
from .tokenize import TokenizeRequest
from .tool_syntax import ToolSyntax
from .tools import AutoCalls, ForcedCall, tool_use, with_call_tokens

THINKING_SWITCH = "enable_thinking"  # the template variable that turns a model's thinking on and off (Qwen3)
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's tool_choice type -> chat's
ERROR_MARK = "Error: "  # before the text of a tool_result marked is_error


def switches_thinking(chat_templates: dict[str, str]) -> bool:
    """Whether the model's chat template reads `enable_thinking`, which `thinking` then sets."""
    return any(THINKING_SWITCH in template for template in chat_templates.values())


# ------------------------------------------------------------------------------------------------------ requests

def parse_messages(body: Any, tool_syntax: ToolSyntax | None = None, split_reasoning: bool = False,
                   thinking_switch: bool = False) -> GenerateRequest:
    """Validate a /v1/messages body. `split_reasoning`: the server splits <think> text from the reply;
    `thinking_switch`: the template reads enable_thinking (switches_thinking)."""
    fields = Fields(body_object(body))
    max_tokens = fields.integer("max_tokens")
    if max_tokens is None or max_tokens < 1:
        raise bad_request("max_tokens is required: a positive integer", param="max_tokens")
    if fields.body.get("thread") is not None:  # a conversation held by the server: the SDK resends it whole after this
        raise bad_request("thread is not supported: this server holds no conversation between requests; send the "
                          "whole conversation in messages", param="thread", code=THREAD_UNSUPPORTED)
    messages, use, thinking, kwargs = _conversation(fields, tool_syntax, thinking_switch, max_tokens)
    call = use if isinstance(use, ForcedCall) else None
    if call is not None and thinking:
        raise bad_request("thinking may not be enabled when tool_choice forces tool use", param="thinking")
    config = fields.get("output_config", (dict,), "an object", {})
    if config.get("effort") is not None:
        raise unsupported("output_config.effort is not supported by this server", "output_config.effort")
    asked = output_grammar(body, config.get("format"), "output_config.format", "anthropic")
    grammar, grammar_param = generation_grammar(call, asked)
    return GenerateRequest(
        chat=True, model=fields.string("model"), prompts=(messages,), stream=fields.boolean("stream"),
        params=with_call_tokens(use, _sampling(body, max_tokens, grammar), tool_syntax), prompt_param="messages",
        forced_call=call, auto_calls=use if isinstance(use, AutoCalls) else None, template_kwargs=kwargs,
        split_reasoning=split_reasoning and call is None, harmony=isinstance(tool_syntax, HarmonyToolSyntax),
        grammar_param=grammar_param)


def parse_count_tokens(body: Any, tool_syntax: ToolSyntax | None = None, thinking_switch: bool = False
                       ) -> TokenizeRequest:
    """Validate a /v1/messages/count_tokens body: the prompt a /v1/messages request of the same fields renders."""
    fields = Fields(body_object(body))
    messages, use, _, kwargs = _conversation(fields, tool_syntax, thinking_switch, None)
    return TokenizeRequest(fields.string("model"), messages, add_special_tokens=True, return_token_strs=False,
                           tools=list(use.tools) if use is not None else None, template_kwargs=kwargs)


def _conversation(fields: Fields, tool_syntax: ToolSyntax | None, thinking_switch: bool, max_tokens: int | None
                  ) -> tuple[list[dict], ForcedCall | AutoCalls | None, bool | None, dict | None]:
    """(the chat messages, the tool use, whether thinking is asked (None: left to the template), the template's
    variables) of a body's model, system, messages, tools, tool_choice and thinking."""
    if fields.string("model") is None:
        raise bad_request("model is required", param="model")
    fields.get("metadata", (dict,), "an object")  # accepted; only its type is checked
    messages = chat_messages(_system(fields.body.get("system")) + _turns(fields.body.get("messages")))
    tools = _chat_tools(fields.get("tools", (list,), "an array"))
    choice, parallel = _chat_tool_choice(fields.get("tool_choice", (dict,), "an object"), tools)
    use = tool_use(tools, choice, bad_request, parallel=parallel, syntax=tool_syntax)
    thinking = _thinking(fields.get("thinking", (dict,), "an object"), max_tokens)
    kwargs = {THINKING_SWITCH: thinking} if thinking is not None and thinking_switch else None
    return messages, use, thinking, kwargs


def _sampling(body: dict, max_tokens: int, grammar: str | None) -> Any:
    """The SamplingParams of a body: Anthropic's temperature, top_p, top_k, stop_sequences (and chat's vLLM
    extensions)."""
    fields = Fields({**body, "stop": body.get("stop_sequences")})
    _check_temperature(fields)
    try:
        return sampling_params(fields, max_tokens, "max_tokens", None, 1, grammar)
    except APIError as e:
        if e.param != "stop":
            raise
        raise bad_request(e.message.replace("stop", "stop_sequences", 1), param="stop_sequences") from None


def _check_temperature(fields: Fields) -> None:
    """Refuse a temperature outside Anthropic's range [0, 1] (chat's, as vLLM's, reaches 100)."""
    temperature = fields.number("temperature", 1.0)
    if not 0 <= temperature <= 1:
        raise bad_request(f"temperature must be between 0 and 1, got {temperature:g}", param="temperature")


def _system(system: Any) -> list[dict]:
    """The system prompt (a string or an array of text blocks) as a system message; none where it is empty."""
    if system is None or system == "":
        return []
    if isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in system):
        return [{"role": "system", "content": _text_parts(system, "system")}]
    if not isinstance(system, str):
        raise bad_request('system must be a string or an array of {"type": "text", "text": ...} blocks',
                          param="system")
    return [{"role": "system", "content": system}]


def _text_parts(blocks: list, param: str) -> list[dict]:
    """Text blocks (`param`: the array's field) as chat's text parts."""
    return [_text_part(block, f"{param}[{j}]") for j, block in enumerate(blocks)]


def _text_part(block: dict, param: str) -> dict:
    """A text block (`param`: its field) as a chat text part."""
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{param}.text must be a string", param=f"{param}.text")
    return {"type": "text", "text": block["text"]}


def _message_text(block: dict, param: str) -> dict:
    """A message's text block (`param`: its field) as a chat text part; its text may not be empty or whitespace
    alone, as Anthropic refuses both."""
    part = _text_part(block, param)
    if not part["text"]:
        raise bad_request(f"{param}: text content blocks must be non-empty", param=f"{param}.text")
    if part["text"].isspace():
        raise bad_request(f"{param}: text content blocks must contain non-whitespace text", param=f"{param}.text")
    return part


def _turns(messages: Any) -> list[dict]:
    """Anthropic's user and assistant turns as chat messages: a user turn's tool_result blocks each a tool message
    (in their place among its text), an assistant turn's tool_use blocks its tool_calls and its thinking its
    reasoning_content."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array of message objects", param="messages")
    out, contents = [], []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_request(f'{param} must be {{"role": "user" | "assistant", "content": ...}}', param=param)
        blocks = _content_blocks(message, param, final=i == len(messages) - 1)
        out += (_assistant_turn if message["role"] == "assistant" else _user_turn)(blocks, f"{param}.content")
        contents.append((message["role"], blocks))
    _check_tool_results(contents)
    if messages[-1]["role"] == "assistant":
        raise unsupported("a last assistant message (prefill) is not supported by this server: the model answers "
                          "in a turn of its own", f"messages[{len(messages) - 1}]")
    return out


def _content_blocks(message: dict, param: str, final: bool) -> list[dict]:
    """A message's content (`param`: the message's field) as content blocks, a string as one text block. Empty
    content is refused as Anthropic refuses it: in every message but a final assistant one."""
    content = message.get("content")
    if isinstance(content, str):
        blocks = [{"type": "text", "text": content}] if content else []
    elif isinstance(content, list) and all(isinstance(block, dict) for block in content):
        blocks = content
    else:
        raise bad_request(f"{param}.content must be a string or an array of content blocks, got "
                          f"{json_type(content)}", param=f"{param}.content")
    if not blocks and not (final and message["role"] == "assistant"):
        raise bad_request(f"{param}: all messages must have non-empty content except for the optional final "
                          "assistant message", param=f"{param}.content")
    return blocks


def _check_tool_results(contents: list[tuple[str, list[dict]]]) -> None:
    """Refuse a tool_result block whose tool_use_id names no tool_use block of the assistant turn just before its
    own, as Anthropic does. `contents`: each message's role and content blocks, already checked; consecutive
    messages of one role are one turn, as Anthropic combines them."""
    calls: set[str] = set()  # the tool_use ids of the last assistant turn
    for role, group in groupby(enumerate(contents), key=lambda item: item[1][0]):
        blocks = [(i, j, block) for i, (_, content) in group for j, block in enumerate(content)]
        if role == "assistant":
            calls = {block["id"] for _, _, block in blocks if block.get("type") == "tool_use"}
            continue
        for i, j, block in blocks:
            if block.get("type") == "tool_result" and block["tool_use_id"] not in calls:
                raise bad_request(f"messages[{i}].content[{j}]: unexpected `tool_use_id` found in `tool_result` "
                                  f"blocks: {block['tool_use_id'][:80]}. Each `tool_result` block must have a "
                                  "corresponding `tool_use` block in the previous message.",
                                  param=f"messages[{i}].content[{j}].tool_use_id")


def _user_turn(blocks: list[dict], param: str) -> list[dict]:
    """A user message's blocks (`param`: their array's field) as chat messages: each tool_result a tool message, the
    text blocks between them user messages."""
    out: list[dict] = []
    texts: list[dict] = []  # text blocks since the last tool result
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            texts.append(_message_text(block, f"{param}[{j}]"))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": texts})
                texts = []
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{param}[{j}].tool_use_id must be a string", param=f"{param}[{j}].tool_use_id")
            failed = block.get("is_error", False)
            if not isinstance(failed, bool):
                raise bad_request(f"{param}[{j}].is_error must be a boolean", param=f"{param}[{j}].is_error")
            content = _result_content(block.get("content"), f"{param}[{j}].content")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": _failed_result(content) if failed else content})
        else:
            raise _unsupported_block(kind, f"{param}[{j}]", "text and tool_result")
    return out + ([{"role": "user", "content": texts}] if texts else [])


def _result_content(content: Any, param: str) -> str | list[dict]:
    """A tool_result's content (a string, or text blocks) as a tool message's."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list) or not all(isinstance(block, dict) for block in content):
        raise bad_request(f"{param} must be a string or an array of text blocks", param=param)
    for j, block in enumerate(content):
        if block.get("type") != "text":
            raise _unsupported_block(block.get("type"), f"{param}[{j}]", "text")
    return _text_parts(content, param)


def _failed_result(content: str | list[dict]) -> str | list[dict]:
    """A tool_result marked is_error as the tool message the template shows: its text after "Error: " (chat
    templates have no field for a failed call, so the model reads the mark as text)."""
    if isinstance(content, str):
        return ERROR_MARK + content
    return [{"type": "text", "text": ERROR_MARK}, *content]


def _assistant_turn(blocks: list[dict], param: str) -> list[dict]:
    texts, calls, thinking = [], [], []
    for j, block in enumerate(blocks):
        kind, where = block.get("type"), f"{param}[{j}]"
        if kind == "text":
            texts.append(_message_text(block, where))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise bad_request(f'{where} must be {{"type": "tool_use", "id": ..., "name": ..., "input": {{...}}}}',
                                  param=where)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise bad_request(f"{where}.thinking must be a string", param=f"{where}.thinking")
            thinking.append(block["thinking"])
        elif kind != "redacted_thinking":  # (encrypted by another server: nothing the template could show)
            raise _unsupported_block(kind, where, "text, tool_use and thinking")
    message: dict[str, Any] = {"role": "assistant", "content": texts}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return [message]


def _unsupported_block(kind: Any, param: str, supported: str) -> APIError:
    if isinstance(kind, str):
        return unsupported(f"{param}: content blocks of type {kind[:40]!r} are not supported by this server "
                           f"({supported} are)", param)
    return bad_request(f"{param} must be a content block with a type", param=param)


def _chat_tools(tools: list | None) -> list | None:
    """Anthropic's client tools ({name, description, input_schema}) in chat's form; server tools (web search,
    bash, ...) are refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{i}] must be an object, got {json_type(tool)}", param=f"tools[{i}]")
        if tool.get("type") not in (None, "custom"):
            raise unsupported(f"tools[{i}]: only client tools (name, description, input_schema) are supported by "
                              f"this server, got {str(tool.get('type'))[:60]!r}", f"tools[{i}]")
        if not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"tools[{i}].input_schema must be a JSON schema object",
                              param=f"tools[{i}].input_schema")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: dict | None, tools: list | None) -> tuple[Any, bool]:
    """(chat's tool_choice, whether calls may be parallel) of Anthropic's tool_choice."""
    if choice is None:
        return None, True
    kind = choice.get("type")
    names = [tool["function"]["name"] for tool in tools or ()]
    if kind not in (*TOOL_CHOICES, "tool"):
        raise bad_request(f'tool_choice.type must be "auto", "any", "tool" or "none", got {kind!r:.80}',
                          param="tool_choice.type")
    if kind in ("any", "tool") and not names:
        raise bad_request(f'tool_choice "{kind}" needs a non-empty tools array', param="tools")
    if kind == "tool" and choice.get("name") not in names:
        raise bad_request(f"tool_choice.name must be the name of one of the tools {names}, got "
                          f"{choice.get('name')!r:.80}", param="tool_choice.name")
    disable_parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable_parallel, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use must be a boolean",
                          param="tool_choice.disable_parallel_tool_use")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}, not disable_parallel
    return (None if kind == "auto" and not names else TOOL_CHOICES[kind]), not disable_parallel


def _thinking(thinking: dict | None, max_tokens: int | None) -> bool | None:
    """Whether `thinking` asks the model to think (None: not given)."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "disabled":
        return False
    if kind not in ("enabled", "adaptive"):
        raise bad_request(f'thinking.type must be "enabled", "adaptive" or "disabled", got {kind!r:.80}',
                          param="thinking.type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1 \
                or (max_tokens is not None and budget >= max_tokens):
            raise bad_request("thinking.budget_tokens must be a positive integer less than max_tokens",
                              param="thinking.budget_tokens")
    if thinking.get("display") == "omitted":
        raise unsupported('thinking.display "omitted" is not supported: thinking comes back as text',
                          "thinking.display")
    return True
