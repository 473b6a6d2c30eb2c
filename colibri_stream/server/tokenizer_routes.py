"""The tokenizer's routes: /tokenize, /detokenize, /tokenizer_info (vLLM's) and /v1/messages/count_tokens
(Anthropic's); the request bodies are tokenize.py's."""

from __future__ import annotations

import functools

from aiohttp import web

from ..errors import InvalidParameterError
from ..tokenizer import ChatTemplateError
from .fields import bad_request
from .parse_anthropic import parse_count_tokens, switches_thinking
from .read_body import read_json
from .state import STATE, ServerState, check_model, json_response, on_worker
from .tokenize import LONG_TOKEN_LIST, TokenizeRequest, parse_detokenize, parse_tokenize, tokenize_body


async def count_message_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt tokens a /v1/messages request of the same fields would use."""
    state = request.app[STATE]
    req = parse_count_tokens(await read_json(request), state.tool_syntax, switches_thinking(state.chat_templates))
    check_model(state, req.model)
    return json_response({"input_tokens": len(await _encode(state, req))})


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize (server/tokenize.py)."""
    state = request.app[STATE]
    req = parse_tokenize(await read_json(request))
    check_model(state, req.model)
    ids = await _encode(state, req)
    token_text = (lambda token_id: state.token_piece(token_id)[0]) if req.return_token_strs else None
    write = functools.partial(tokenize_body, ids, state.engine.max_seq_len, token_text)
    body = await on_worker(write) if len(ids) > LONG_TOKEN_LIST else write()
    return web.Response(body=body, content_type="application/json")


async def _encode(state: ServerState, req: TokenizeRequest) -> list[int]:
    """The token ids of a tokenizer request's prompt, counted whatever its length (as vLLM's /tokenize: the
    answer says max_model_len); what the engine refuses is a 400."""
    try:
        return await state.engine.encode(req.prompt, req.add_special_tokens, req.tools, req.template_kwargs,
                                         fit_context=False)
    except InvalidParameterError as e:
        raise bad_request(str(e), param=e.param) from e
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from e


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize (server/tokenize.py)."""
    state = request.app[STATE]
    body = await read_json(request)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    long = isinstance(tokens, list) and len(tokens) > LONG_TOKEN_LIST
    parse = functools.partial(parse_detokenize, body, state.engine.model_config.vocab_size)
    model, ids = await on_worker(parse) if long else parse()
    check_model(state, model)
    decode = functools.partial(state.decode, ids)
    return json_response({"prompt": await on_worker(decode) if long else decode()})


async def tokenizer_info(request: web.Request) -> web.Response:
    """GET /tokenizer_info, as vLLM's: the tokenizer's class, its tokenizer_config.json fields, special tokens and
    chat template (what lm-evaluation-harness reads to tokenize through /tokenize instead of a download)."""
    return json_response(request.app[STATE].engine.tokenizer.info())
