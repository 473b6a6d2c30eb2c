"""How deep the JSON the server reads may nest. Python's json module, repr() and the chat template's tojson recurse
once a level of arrays and objects and raise RecursionError (not ValueError) near the interpreter's limit of 1000
frames; orjson reads bodies up to 1024 levels deep. So a request body nested deeper than MAX_JSON_DEPTH is a 400
(read_body.py), and a JSON text inside a request or a reply (an earlier tool call's arguments, a schema sent as
text, the arguments a model writes) is read with `json_text`, which refuses one nested deeper as it refuses any
other text that is not JSON."""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 256  # levels of arrays and objects; a value that is neither is 0 deep


def json_text(text: str) -> Any:
    """The value of a JSON text (json.loads); ValueError where it is not JSON or nests deeper than
    MAX_JSON_DEPTH."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"the JSON text nests more than {MAX_JSON_DEPTH} levels deep") from None
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and nested_deeper(value, MAX_JSON_DEPTH):
        raise ValueError(f"the JSON text nests more than {MAX_JSON_DEPTH} levels deep")
    return value


def nested_deeper(value: Any, depth: int) -> bool:
    """Whether `value` holds arrays and objects nested more than `depth` levels deep (a decoded JSON value; its
    containers walked a level at a time)."""
    level = [value] if isinstance(value, (list, dict)) else []
    for _ in range(depth):
        level = [child for container in level
                 for child in (container.values() if isinstance(container, dict) else container)
                 if isinstance(child, (list, dict))]
        if not level:
            return False
    return bool(level)
