"""vLLM's structured-output fields: `structured_outputs` ({"json": schema, "regex": ..., "choice": [...],
"grammar": Lark text, "json_object": true}, one of them) and the older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar` it replaced, turned into a grammar (../structured.py).

Grammars are Lark in llguidance's dialect (`start: ...` rules, /regex/ terminals), not vLLM's other backends'
EBNF; regular expressions are Rust regex, matched whole. vLLM's options of its own backends
(`disable_fallback`, `disable_any_whitespace`, `disable_additional_properties`, `whitespace_pattern`, and
`guided_decoding_backend`, `guided_whitespace_pattern`) are accepted and change nothing: JSON is always laid out
as json.dumps writes it. `structural_tag` is refused.
"""

from __future__ import annotations

from typing import Any

from ..structured import choice_grammar, json_schema_grammar, lark_grammar, regex_grammar
from ..errors import InvalidParameterError
from .json_depth import json_text

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_grammar(body: dict) -> tuple[str, str] | None:
    """(the field that asked, its grammar) of a body's vLLM structured-output fields; None where they ask for
    nothing. Raises InvalidParameterError naming the field for a bad value or more than one constraint."""
    asked: list[tuple[str, str, Any]] = []  # (field, kind, value)
    spec = body.get("structured_outputs")
    if spec is not None:
        if not isinstance(spec, dict):
            raise InvalidParameterError("structured_outputs must be an object such as {\"json\": <schema>}",
                                        "structured_outputs")
        for key, value in spec.items():
            if key == "structural_tag" and value is not None:
                raise InvalidParameterError("structured_outputs.structural_tag is not supported by this server",
                                            "structured_outputs.structural_tag")
            if key not in CONSTRAINTS + OPTIONS + ("structural_tag",):
                raise InvalidParameterError(f"structured_outputs has no field {key!r:.40}; it takes one of "
                                            f"{', '.join(CONSTRAINTS)}", "structured_outputs")
            if key in CONSTRAINTS and value is not None and value is not False:
                asked.append((f"structured_outputs.{key}", key, value))
    asked += [(name, kind, body[name]) for name, kind in GUIDED.items() if body.get(name) is not None]
    if len(asked) > 1:
        raise InvalidParameterError(f"ask for one output constraint, not {len(asked)}: "
                                    f"{', '.join(name for name, _, _ in asked)}", asked[1][0])
    if not asked:
        return None
    name, kind, value = asked[0]
    return name, _grammar(name, kind, value)


def _grammar(name: str, kind: str, value: Any) -> str:
    if kind == "json_object":
        if value is not True:
            raise InvalidParameterError(f"{name} must be true", name)
        return json_schema_grammar({"type": "object"}, name)
    if kind == "json":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json_text(value)
            except ValueError:
                raise InvalidParameterError(f"{name} must be a JSON schema (an object, or its JSON text)",
                                            name) from None
        if not isinstance(value, (dict, bool)):
            raise InvalidParameterError(f"{name} must be a JSON schema (an object, or its JSON text)", name)
        return json_schema_grammar(value, name)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise InvalidParameterError(f"{name} must be a non-empty list of non-empty strings", name)
        return choice_grammar(value, name)
    if not isinstance(value, str) or not value:
        raise InvalidParameterError(f"{name} must be a non-empty string", name)
    return regex_grammar(value, name) if kind == "regex" else lark_grammar(value, name)
