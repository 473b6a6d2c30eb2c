"""Reading a request's body as JSON: its size limit (also announced with `Expect: 100-continue`), its
Content-Encoding, the limits on the JSON values it holds and on their nesting, and the 400 of a body that is not
JSON."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ..errors import APIError
from .error_replies import error_response
from .fields import bad_request
from .json_depth import MAX_JSON_DEPTH
from .state import STATE, ServerState, count_request, on_worker

READABLE_ENCODINGS = ("identity", "gzip", "deflate")  # request bodies aiohttp decodes without extra packages
LARGE_BODY_BYTES = 256 << 10  # bodies over this size are read as JSON on a worker thread
# The most a body's JSON may weigh (`json_weight`): orjson holds the GIL while it builds the values, so every other
# request and stream of the server waits for the whole reading
MAX_JSON_WEIGHT = 300_000
CONTAINER_WEIGHT = 6  # an array or an object (which the garbage collector tracks too) weighs as much as 6 strings
ORJSON_DEPTH = 1024  # the deepest nesting orjson reads
_DEPTH_PADDING = (b"[" * (ORJSON_DEPTH - MAX_JSON_DEPTH), b"]" * (ORJSON_DEPTH - MAX_JSON_DEPTH))


def too_large(state: ServerState) -> APIError:
    return APIError(413, f"the request body exceeds the server's limit of {state.max_body_bytes} bytes",
                    code="request_too_large")


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue` (curl sends it with bodies over 1 MiB): a body announced over the limit is refused
    before the client sends it; aiohttp's default answers "100 Continue" to anything. Runs before the middlewares,
    so it answers in OpenAI's shape itself."""
    state = request.app[STATE]
    if request.headers.get("Expect", "").lower() != "100-continue":
        error = APIError(417, f"unsupported Expect: {request.headers.get('Expect', '')[:64]!r}",
                         code="expectation_failed")
    elif request.content_length is not None and request.content_length > state.max_body_bytes:
        error = too_large(state)
    else:
        if request.version >= (1, 1):  # as aiohttp's default handler
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the response proper has not started
        return None
    response = error_response(error, path=request.path)
    response.force_close()  # Connection: close: the client need not send the body to keep the connection
    count_request(request, error.status)
    return response


async def read_json(request: web.Request) -> Any:
    """The body as JSON (`read_body`, `json_body`; a large one read on a worker thread)."""
    raw = await read_body(request)
    if len(raw) > LARGE_BODY_BYTES:
        return await on_worker(lambda: json_body(raw))
    return json_body(raw)


async def read_body(request: web.Request) -> bytes:
    """The body's bytes, whatever its Content-Type says (curl -d sends form-encoded); a body that cannot be read
    (a Content-Encoding it does not decode to) is a 400 like one that is not JSON. A Content-Length over the limit
    is a 413 before anything is read (aiohttp then reads and drops the body for up to 10 s, so that the client,
    which sends the whole body before it reads the answer, gets the 413 rather than a reset connection)."""
    state = request.app[STATE]
    if request.content_length is not None and request.content_length > state.max_body_bytes:
        raise too_large(state)
    encoding = request.headers.get("Content-Encoding", "identity")
    if encoding.strip().lower() not in READABLE_ENCODINGS:
        raise unreadable_encoding(encoding)
    try:
        raw = await request.read()
    except web.RequestPayloadError as e:
        raise bad_request(f"the request body could not be read: {_payload_error(e)}") from None
    if not raw:
        raise bad_request("the request body is empty; send a JSON object")
    return raw


def json_body(raw: bytes) -> Any:
    """A body's bytes as JSON; a 413 where they hold more values than the server reads at once
    (`MAX_JSON_WEIGHT`), a 400 where they are not JSON or nest deeper than MAX_JSON_DEPTH (json_depth.py)."""
    if len(raw) * CONTAINER_WEIGHT > MAX_JSON_WEIGHT:  # (a smaller body cannot weigh more)
        containers, strings = json_weight(raw)
        if containers * CONTAINER_WEIGHT + strings > MAX_JSON_WEIGHT:
            raise APIError(413, f"the request body holds too many JSON values to read: {containers} arrays and "
                                f"objects and {strings} strings (an array or object counts as {CONTAINER_WEIGHT} "
                                f"strings; the server reads at most {MAX_JSON_WEIGHT})", code="request_too_large")
    read, value = _shallow_json(raw)
    if read:
        return value
    try:  # read alone: the error, with its positions, of a body that is not JSON
        orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    raise bad_request(f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep")


def _shallow_json(raw: bytes) -> tuple[bool, Any]:
    """(True, the value) of a JSON text nested at most MAX_JSON_DEPTH levels deep, else (False, None). The text is
    read inside ORJSON_DEPTH - MAX_JSON_DEPTH arrays, so that orjson's own depth limit refuses a deeper one in the
    one pass that reads it."""
    try:
        value = orjson.loads(_DEPTH_PADDING[0] + raw + _DEPTH_PADDING[1])
    except orjson.JSONDecodeError:
        return False, None
    for _ in range(len(_DEPTH_PADDING[0])):
        if not (isinstance(value, list) and len(value) == 1):  # more than one value: "1, 2" or "1]], [[2"
            return False, None
        value = value[0]
    return True, value


def json_weight(raw: bytes) -> tuple[int, int]:
    """(arrays and objects, strings) a JSON text holds at most: its opening brackets and half its quotes, counted
    whether they are syntax or characters inside a string."""
    containers = raw.count(b"[") + raw.count(b"{")
    strings = raw.count(b'"') // 2
    return containers, strings


def unreadable_encoding(encoding: str | None) -> APIError:
    """415 for a request body in a Content-Encoding (named when known) that this server does not decode."""
    named = "the request's Content-Encoding" if encoding is None else f"Content-Encoding {encoding.strip()[:100]!r}"
    return APIError(415, f"{named} is not supported: send the body as {', '.join(READABLE_ENCODINGS)}",
                    code="unsupported_content_encoding")


def _payload_error(error: web.RequestPayloadError) -> str:
    """What the body parser said, without aiohttp's "400, message:" prefix."""
    cause = error.__cause__
    return getattr(cause, "message", None) or str(cause or error)
