"""The Responses API (`POST /v1/responses`), the OpenAI SDK's newer endpoint for text generation, over the same
engine requests as chat completions.

`input` (a string, or message items whose content is a string or input_text / output_text parts) and
`instructions` (a system message first) go through the model's chat template; `max_output_tokens`, `temperature`,
`top_p`, `stream` and the vLLM extensions of chat (`top_k`, `min_p`, `seed`, `stop`, penalties,
`structured_outputs`, ...) are read as chat reads them; `text.format` json_object or json_schema constrains the
text as chat's response_format does; function tools with tool_choice "required" or a named function force a call
as chat does (server/tools.py), answered as function_call items; with tool_choice "auto" (the default with tools)
the calls the model writes in its chat template's syntax (tool_syntax.py) become function_call items after the
message of the text before them (a model whose template teaches no syntax answers with the message alone).
function_call / function_call_output items in `input` carry earlier calls and their results back (an output
as a string or text parts).
A thinking model's <think> text is a reasoning item before the message (its reasoning_text streamed with
response.reasoning_text.delta events), and reasoning items in `input` go back to the template as the next
assistant turn's reasoning.
Responses are not stored: `previous_response_id` is refused, and `store` is accepted and changes nothing (as where
a server keeps no state). As in chat, what this server does not do is a 400 naming the field rather than something
silently dropped: tools other than functions, images and files, reasoning settings other than `effort` (which
reaches the chat template as `reasoning_effort`, as chat's field does), logprobs (`top_logprobs`, `include`),
truncation "auto".
Its replies are render_responses.py's.
"""

from __future__ import annotations

from typing import Any

from .chat_messages import chat_messages
from .fields import Fields, bad_request, body_object, json_type, unsupported
from .generate_request import GenerateRequest
from .harmony import HarmonyToolSyntax
from .params import generation_grammar, output_grammar, reasoning_effort, sampling_params, with_reasoning_effort
from .tool_syntax import ToolSyntax
from .tools import AutoCalls, ForcedCall, tool_use, with_call_tokens

INPUT_TEXT_PARTS = ("input_text", "output_text", "text")  # text content parts of an input message
ITEM_STATUSES = ("in_progress", "completed", "incomplete")  # an input item's status, as a response wrote it
MAX_METADATA_PAIRS = 16
# include values already met: reasoning items carry their text in the clear (there is nothing encrypted), which
# the client sends back as it would the encrypted content (the Agents SDK asks for it when nothing is stored)
INCLUDED_ANYWAY = ("reasoning.encrypted_content",)


def parse_response(body: Any, tool_syntax: ToolSyntax | None = None, split_reasoning: bool = False
                   ) -> GenerateRequest:
    """Validate a /v1/responses body."""
    fields = Fields(body_object(body))
    _reject_unsupported(fields)
    fields.string("user")  # accepted for compatibility; only the types are checked
    fields.boolean("store", True)
    metadata = _metadata(fields.get("metadata", (dict,), "an object", {}))
    options = fields.get("stream_options", (dict,), "an object")
    if options is not None and not body.get("stream"):
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    messages = chat_messages(_input_messages(body.get("input")), "input")
    instructions = fields.string("instructions")
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    stream = fields.boolean("stream")
    text = fields.get("text", (dict,), "an object", {})
    asked = output_grammar(body, text.get("format"), "text.format", "responses")
    given_tools = fields.get("tools", (list,), "an array")
    tools = _chat_tools(given_tools)
    parallel = fields.boolean("parallel_tool_calls", True)
    use = tool_use(tools, _chat_tool_choice(body.get("tool_choice")), bad_request, parallel, tool_syntax)
    call = use if isinstance(use, ForcedCall) else None
    grammar, grammar_param = generation_grammar(call, asked)
    params = with_call_tokens(use, sampling_params(fields, fields.integer("max_output_tokens"), "max_output_tokens",
                                                   None, 1, grammar), tool_syntax)
    effort = reasoning_effort(fields.get("reasoning", (dict,), "an object", {}).get("effort"), "reasoning.effort")
    # what the response object repeats of the request, as the API answers it (tools and tool_choice as given;
    # `store` stays false: nothing is stored)
    settings = {"instructions": instructions, "metadata": metadata, "parallel_tool_calls": parallel,
                "reasoning": {"effort": effort, "summary": None},
                "text": {"format": text.get("format") or {"type": "text"}}, "tools": given_tools or [],
                "tool_choice": body.get("tool_choice", "auto")}
    return GenerateRequest(chat=True, model=fields.string("model"), prompts=(messages,), params=params,
                           stream=stream, prompt_param="input", forced_call=call,
                           auto_calls=use if isinstance(use, AutoCalls) else None,
                           split_reasoning=split_reasoning and call is None, grammar_param=grammar_param,
                           harmony=isinstance(tool_syntax, HarmonyToolSyntax),
                           template_kwargs=with_reasoning_effort(None, effort), settings=settings)


def _metadata(metadata: dict) -> dict:
    """The request's metadata as OpenAI bounds it: at most 16 pairs of string keys (up to 64 characters) and string
    values (up to 512)."""
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(f"metadata holds {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed",
                          param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise bad_request(f"metadata[{key[:64]!r}]: keys are strings of up to 64 characters and values strings "
                              f"of up to 512, got {json_type(value)}", param="metadata")
    return metadata


def _chat_tools(tools: list | None) -> list | None:
    """The Responses API's function tools ({"type": "function", "name", "parameters", ...}) in chat's form; other
    tool types (web search, files, ...) are refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else json_type(tool)
            raise unsupported(f"tools[{i}]: only function tools are supported by this server, got {kind!r}",
                              f"tools[{i}]")
        out.append(tool if "function" in tool else
                   {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    """The Responses API's tool_choice ({"type": "function", "name"} for a named function) in chat's form."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _reject_unsupported(fields: Fields) -> None:
    body = fields.body
    if body.get("previous_response_id") is not None:
        raise unsupported("previous_response_id is not supported: this server does not store responses; send the "
                          "conversation in input", "previous_response_id")
    if body.get("conversation") is not None:
        raise unsupported("conversation is not supported: this server does not store conversations", "conversation")
    reasoning = fields.get("reasoning", (dict,), "an object", {})
    if any(value is not None for key, value in reasoning.items() if key != "effort"):  # null asks nothing
        raise unsupported("reasoning settings other than effort are not supported by this server (reasoning "
                          "summaries: the reasoning comes back whole)", "reasoning")
    if body.get("prompt") is not None:
        raise unsupported("prompt is not supported by this server", "prompt")
    if fields.integer("top_logprobs"):
        raise unsupported("top_logprobs is not supported in /v1/responses (it is in chat completions)",
                          "top_logprobs")
    asked = [item for item in fields.get("include", (list,), "an array", ()) if item not in INCLUDED_ANYWAY]
    if asked:
        raise unsupported(f"include {asked[0]!r:.80} is not supported by this server", "include")
    if body.get("truncation") not in (None, "disabled"):
        raise unsupported('truncation is not supported; only "disabled" is accepted (a prompt over the context '
                          'is refused)', "truncation")
    if body.get("background"):
        raise unsupported("background is not supported by this server", "background")


def _input_messages(value: Any) -> list[dict]:
    """`input` as chat messages with string or text-part content (checked again by chat_messages.chat_messages)."""
    if value is None:
        raise bad_request("input is required", param="input")
    if isinstance(value, str):
        if not value:
            raise bad_request("input must not be empty", param="input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request(f"input must be a string or a non-empty array of items, got {json_type(value)}",
                          param="input")
    messages, reasoning = [], None  # reasoning: an earlier reasoning item's text, for the assistant turn after it
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{param} must be an object, got {json_type(item)}", param=param)
        if item.get("id") is not None and not isinstance(item["id"], str):
            raise bad_request(f"{param}.id must be a string, got {json_type(item['id'])}", param=f"{param}.id")
        if item.get("status") is not None and item["status"] not in ITEM_STATUSES:
            raise bad_request(f"{param}.status must be one of {', '.join(ITEM_STATUSES)}, got {item['status']!r:.80}",
                              param=f"{param}.status")
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = _reasoning_text(item, param)
            continue
        if kind in ("function_call", "function_call_output"):  # an earlier call and its result
            message = _call_message(item, kind, param, messages)
            if message is not None:
                messages.append(message)
            if reasoning is not None and kind == "function_call":
                messages[-1]["reasoning_content"], reasoning = reasoning, None
            continue
        if kind != "message":
            raise unsupported(f"{param}: items of type {kind!r} are not supported by this server (messages, "
                              f"function calls and their outputs are)", param)
        messages.append({"role": item.get("role"), "content": _text_parts(item.get("content"), f"{param}.content")})
        if reasoning is not None and item.get("role") == "assistant":
            messages[-1]["reasoning_content"], reasoning = reasoning, None
    return messages


def _text_parts(content: Any, param: str) -> Any:
    """A message's content or a function call's output (`param`: its field) as chat content: a list of text parts
    (input_text, output_text) as chat's text parts; anything else as it is, for chat_messages to check."""
    if not isinstance(content, list):
        return content
    parts = []
    for j, part in enumerate(content):
        part_kind = part.get("type") if isinstance(part, dict) else None
        if part_kind not in INPUT_TEXT_PARTS or not isinstance(part.get("text"), str):
            raise unsupported(f"{param}[{j}]: only text parts are supported by this server, got {part_kind!r}",
                              param)
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _reasoning_text(item: dict, param: str) -> str:
    """The text of a reasoning input item: its reasoning_text content, else its summary."""
    for field in ("content", "summary"):
        parts = item.get(field)
        if parts:
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise bad_request(f'{param}.{field} must be an array of {{"type": ..., "text": ...}} parts',
                                  param=f"{param}.{field}")
            return "".join(p["text"] for p in parts)
    return ""


def _call_message(item: dict, kind: str, param: str, messages: list) -> dict | None:
    """A function_call item as an assistant message's tool call (joined to the one before when that holds calls
    only: None then), or a function_call_output item as a tool message."""
    if not isinstance(item.get("call_id"), str):
        raise bad_request(f"{param}.call_id must be a string", param=f"{param}.call_id")
    if kind == "function_call_output":
        output = _text_parts(item.get("output"), f"{param}.output")
        return {"role": "tool", "tool_call_id": item["call_id"], "content": output}
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
    previous = messages[-1] if messages else None
    if previous is not None and previous.get("role") == "assistant" and previous.get("tool_calls") \
            and not previous.get("content"):
        previous["tool_calls"].append(call)
        return None
    return {"role": "assistant", "content": None, "tool_calls": [call]}
