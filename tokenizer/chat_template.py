"""Render Hugging Face chat templates (Jinja) the way transformers' `apply_chat_template(tokenize=False)` does.

Templates come from model folders downloaded from the internet, so they run in Jinja's immutable sandbox. The
environment matches transformers': `trim_blocks`, `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter
that keeps non-ASCII text and accepts `indent`, and the globals `raise_exception` and `strftime_now`. The
`{% generation %}` tag that transformers uses to mark assistant tokens renders its body unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ColibriError
from .prompt_bound import CharLimit, PromptTooManyCharsError

# Names a message's reasoning may arrive under; templates read the first. transformers fills it from the others.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Names no template variable may take: what the renderer passes the template itself, its own parameters, and
# Jinja's `self` (the template's own reference, which a variable of that name never reaches).
RESERVED_VARIABLES = ("messages", "tools", "documents", "source", "char_limit", "self")


class ChatTemplateError(ColibriError):
    """A conversation cannot be turned into a prompt: no template, a malformed message, or the template refused it."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers tracks assistant spans with it; here it is a no-op."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters and sorts keys; templates are written against this one.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template for `source` (cached: a model's template is compiled once)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template is not valid Jinja (line {e.lineno}): {e.message}") from e


def _normalise_messages(messages: Any) -> list[dict]:
    """Copies of `messages` without None-valued keys and with reasoning under every name templates read."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object with a role, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] has no string 'role'")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat_template(source: str, messages: Sequence[Mapping[str, Any]], /, *, add_generation_prompt: bool,
                         tools: Sequence[Mapping[str, Any]] | None = None, documents: Sequence[Mapping] | None = None,
                         char_limit: CharLimit | None = None, **variables: Any) -> str:
    """The prompt text for `messages`; `variables` (bos_token, eos_token, template options) go to the template.

    With `char_limit`, rendering stops with PromptTooManyCharsError as soon as the text grows past the characters
    that the context can hold, so a huge conversation is never rendered whole.

    Raises ChatTemplateError for malformed messages or tools, for a variable named as one of RESERVED_VARIABLES,
    and for any error the template raises, including its own `raise_exception(...)` calls (e.g. "roles must
    alternate user/assistant").
    """
    reserved = next((name for name in variables if name in RESERVED_VARIABLES), None)
    if reserved is not None:
        raise ChatTemplateError(f"{reserved!r} cannot be set as a template variable: {', '.join(RESERVED_VARIABLES)} "
                                f"are the renderer's own names")
    messages = _normalise_messages(messages)
    if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
        raise ChatTemplateError("tools must be a list of JSON-schema objects")
    template = compile_template(source)
    try:
        return _render(template, {**variables, "messages": messages, "tools": tools, "documents": documents,
                                  "add_generation_prompt": add_generation_prompt}, char_limit)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e.message}") from e
    except PromptTooManyCharsError:
        raise
    except Exception as e:  # the template is foreign code; whatever it trips on is a bad request, not a crash
        raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from e


def _render(template: jinja2.Template, context: dict[str, Any], char_limit: CharLimit | None) -> str:
    """The template's text for `context`, rendered piece by piece when a limit must be checked on the way."""
    if char_limit is None:
        return template.render(context)
    pieces, chars = [], 0
    for piece in template.generate(context):
        chars += len(piece)
        char_limit.check_rendered(chars)
        pieces.append(piece)
    return "".join(pieces)
