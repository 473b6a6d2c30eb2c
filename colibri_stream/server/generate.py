"""The generation routes (chat and text completions, Responses, Anthropic's Messages): parse, admit, run on the
engine, render as one JSON body or as an SSE stream."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..errors import APIError, ColibriError
from .admission import admit
from .error_replies import engine_error
from .generate_request import GenerateRequest
from .generations import Generations
from .parse_anthropic import parse_messages, switches_thinking
from .parse_openai import parse_chat, parse_completion
from .parse_responses import parse_response
from .read_body import LARGE_BODY_BYTES, json_body, read_body
from .render_anthropic import MessagesResponder
from .render_openai import Responder
from .render_responses import ResponsesResponder
from .state import STATE, ServerState, check_model, json_response, on_worker

log = logging.getLogger(__name__)

# Fields from which a request's parse builds a grammar (llguidance: 0.2 s for a 3000-property schema, 0.9 s for 50000
# choices), so the parse runs on a worker thread
GRAMMAR_FIELDS = ("response_format", "text", "tools", "structured_outputs", "guided_json", "guided_regex",
                  "guided_choice", "guided_grammar", "output_config")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    return await _generate(request, functools.partial(parse_chat, tool_syntax=state.tool_syntax,
                                                      split_reasoning=state.split_reasoning), _choices_responder)


async def completions(request: web.Request) -> web.StreamResponse:
    fim_tokens = request.app[STATE].fim_tokens
    return await _generate(request, functools.partial(parse_completion, fim_tokens=fim_tokens), _choices_responder)


async def responses(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    return await _generate(request, functools.partial(parse_response, tool_syntax=state.tool_syntax,
                                                      split_reasoning=state.split_reasoning),
                           lambda req, state: ResponsesResponder(req, state.model_name))


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages, Anthropic's Messages API (server/parse_anthropic.py)."""
    state = request.app[STATE]
    return await _generate(request, functools.partial(parse_messages, tool_syntax=state.tool_syntax,
                                                      split_reasoning=state.split_reasoning,
                                                      thinking_switch=switches_thinking(state.chat_templates)),
                           lambda req, state: MessagesResponder(req, state.model_name))


def _choices_responder(req: GenerateRequest, state: ServerState) -> Responder:
    """The responder of chat and completions: choices of chunks or of a whole completion."""
    return Responder(req, state.model_name, state.token_piece, state.decode)


async def _generate(request: web.Request, parse: Callable[[Any], GenerateRequest],
                    make_responder: Callable[[GenerateRequest, ServerState],
                                             Responder | ResponsesResponder | MessagesResponder]
                    ) -> web.StreamResponse:
    state = request.app[STATE]
    if state.draining:
        raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
    req = await _parse(request, parse)
    check_model(state, req.model)
    responder = make_responder(req, state)
    generations = Generations(state.engine, responder.id)
    start = time.perf_counter()
    with state.in_flight():
        try:
            admission = await admit(state.engine, req, state.decode)
            await generations.start(admission.prompt_token_ids, req.params)
            responder.admitted(admission)
            if req.stream:
                return await _stream(request, state, responder, generations)
            async for index, out in generations.outputs():
                state.metrics.observe(out)
                responder.add(out, index)
            return json_response(responder.response())
        except ColibriError as e:
            raise engine_error(e, req) from e
        finally:
            # Once the response is out the client may hang up and cancel this handler: aclose() does not wait then.
            state.metrics.e2e.observe(time.perf_counter() - start)
            await generations.aclose()


async def _parse(request: web.Request, parse: Callable[[Any], GenerateRequest]) -> GenerateRequest:
    """The request's body read and parsed; off the event loop where that takes long: a large body (tens of
    thousands of chat messages), or one from which the parse builds a grammar (a schema, a regex, thousands of
    choices can take a second)."""
    raw = await read_body(request)
    if len(raw) > LARGE_BODY_BYTES:  # read as JSON and parsed on a worker thread
        return await on_worker(lambda: parse(json_body(raw)))
    body = json_body(raw)
    if isinstance(body, dict) and any(body.get(name) for name in GRAMMAR_FIELDS):
        return await on_worker(functools.partial(parse, body))
    return parse(body)


async def _stream(request: web.Request, state: ServerState,
                  responder: Responder | ResponsesResponder | MessagesResponder,
                  generations: Generations) -> web.StreamResponse:
    """Send the request's outputs as SSE events (the responder's opening ones, one or none per output, its
    closing ones); keep-alive comments fill silences (a long prefill)."""
    stream = responder.framing(request, state.keepalive_interval, state.send_timeout)
    try:
        await stream.open()
        for event in responder.opening():
            await stream.send(event)
        try:
            async for index, out in generations.outputs():
                state.metrics.observe(out)
                for event in responder.events(out, index):
                    await stream.send(event)
        except ColibriError as e:  # after the 200, an error travels in the stream
            for event in responder.stream_error(engine_error(e, responder.request)):
                await stream.send(event)
        except ConnectionResetError:
            raise
        except Exception:  # a fault of the server's own (rendering): in the stream too, not as a second response
            log.exception("error while streaming %s", responder.id)
            for event in responder.stream_error(APIError(500, "internal server error", type="server_error")):
                await stream.send(event)
        else:
            for event in responder.closing():
                await stream.send(event)
        await stream.close()
    except ConnectionResetError as e:  # the client left or stopped reading; the caller aborts the request
        log.debug("client of %s disconnected: %s", responder.id, e)
    finally:
        stream.stop_keepalive()
    return stream.response
