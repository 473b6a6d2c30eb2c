"""Typed reads of a request body's fields, and the 400 errors that name a wrong one."""

from __future__ import annotations

from typing import Any

from ..errors import APIError


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(message: str, param: str) -> APIError:
    return bad_request(message, param=param, code="unsupported_parameter")


class Fields:
    """Typed reads of a request body's fields; a present field of the wrong type is a 400 that names it."""

    def __init__(self, body: dict):
        self.body = body

    def get(self, name: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:  # absent or null
            return default
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise bad_request(f"{name} must be {what}, got {json_type(value)}", param=name)
        return value

    def number(self, name: str, default: float) -> float:
        return float(self.get(name, (int, float), "a number", default))

    def integer(self, name: str, default: int | None = None) -> int | None:
        value = self.body.get(name)
        if isinstance(value, float) and value.is_integer() and abs(value) >= 2**63:
            # orjson reads an integer literal past 64 bits as a float: say so rather than "got a number"
            raise bad_request(f"{name} must fit in 64 bits", param=name)
        return self.get(name, (int,), "an integer", default)

    def boolean(self, name: str, default: bool = False) -> bool:
        return self.get(name, (bool,), "a boolean", default)

    def string(self, name: str) -> str | None:
        return self.get(name, (str,), "a string")

    def strings(self, name: str) -> tuple[str, ...]:
        value = self.get(name, (str, list), "a string or a list of strings", ())
        values = [value] if isinstance(value, str) else value
        if not all(isinstance(v, str) for v in values):
            raise bad_request(f"{name} must be a string or a list of strings", param=name)
        return tuple(values)

    def integers(self, name: str) -> tuple[int, ...]:
        values = self.get(name, (list,), "a list of integers", ())
        if not all(is_int(v) for v in values):
            raise bad_request(f"{name} must be a list of integers", param=name)
        return tuple(values)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_type(value: Any) -> str:
    """What a decoded JSON value is, in JSON's words ("a string", "null")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def body_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {json_type(body)}")
    return body
