"""The load generator: streamed requests to any OpenAI-compatible server, timed chunk by chunk by the client.

Requests start at a fixed concurrency (a new one as soon as one ends) or as a Poisson process at a given rate
(optionally capped by the concurrency). Every request streams with `stream_options.include_usage`, so token counts
are the server's own; a server that sends no usage is counted one token per content chunk. The server's /metrics
page is read before and after the run: on a Colibri server it gives the step timings of the same window.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field

import aiohttp
import orjson
from tqdm import tqdm

from ..errors import ColibriError

# Synthetic prompts draw from these words: common English, about one token each in BPE vocabularies.
_WORDS = ("the of and to in is was for on that with as by at from his her an are were which this be or had not "
          "but what all when there can one more time up out about so into than them only other new some could "
          "these two may first then do any like my now over such our man me even most made after also did many "
          "before must through back years where much your way well down should because each just those people how "
          "too little state good very make world still own see men work long get here between both life being under "
          "never day same another know while last might us great old year off come since against go came right used "
          "take three").split()


@dataclass(frozen=True)
class BenchConfig:
    """What to send, where, and how fast."""

    url: str  # the server's address: http://host:port, with or without /v1
    prompts: tuple[str | list[int], ...]  # used in turn; token ids only with endpoint "completions"
    num_requests: int
    output_len: int  # max_tokens of every request
    model: str | None = None  # None: the first model the server lists
    endpoint: str = "chat"  # chat (/v1/chat/completions) | completions (/v1/completions)
    concurrency: int | None = None  # most requests in flight; None: no limit
    request_rate: float | None = None  # Poisson arrivals per second; None: start requests as fast as allowed
    ignore_eos: bool = False  # ask for exactly output_len tokens (a vLLM extension that Colibri accepts)
    temperature: float = 0.0
    api_key: str | None = None
    seed: int = 0  # arrival times
    timeout: float = 600.0  # seconds per request

    @property
    def api_base(self) -> str:
        root = self.url.rstrip("/")
        return root if root.endswith("/v1") else root + "/v1"

    @property
    def metrics_url(self) -> str:
        return self.api_base[: -len("/v1")] + "/metrics"


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from when it was sent."""

    status: str  # "200", another HTTP status, "stream_error" (an error event after the 200) or an exception name
    latency: float = 0.0  # to the end of the stream (or the failure)
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk with content
    prompt_tokens: int | None = None  # the server's usage; None when it sent none
    output_tokens: int | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "200"

    @property
    def ttft(self) -> float | None:
        """Seconds to the first chunk with content."""
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def num_output_tokens(self) -> int:
        """The server's completion tokens, or one per content chunk when it sent no usage."""
        return len(self.chunk_times) if self.output_tokens is None else self.output_tokens


@dataclass
class BenchRun:
    """Everything one run measured: per-request results and the server's /metrics around the run."""

    config: BenchConfig
    model: str
    results: list[RequestResult]
    duration: float  # seconds from the first request sent to the last one finished
    metrics_before: str | None  # the /metrics text; None when the server has none
    metrics_after: str | None


def synthetic_prompts(num: int, input_len: int, seed: int = 0) -> tuple[str, ...]:
    """`num` distinct prompts of `input_len` random common words (the report gives the server's token count)."""
    rng = random.Random(seed)
    return tuple(" ".join(rng.choices(_WORDS, k=input_len)) for _ in range(num))


def read_prompts(path: str) -> tuple[str, ...]:
    """The non-blank lines of a file, one prompt each."""
    with open(path, encoding="utf-8") as f:
        prompts = tuple(line.rstrip("\n") for line in f if line.strip())
    if not prompts:
        raise ColibriError(f"{path} holds no prompts (one per line)")
    return prompts


async def run_benchmark(config: BenchConfig, progress: bool = True) -> BenchRun:
    """Send the run's requests and time them."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connector = aiohttp.TCPConnector(limit=0)  # the concurrency limit is ours, not the pool's
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
        model = config.model or await _first_model(session, config.api_base)
        before = await _scrape(session, config.metrics_url)
        with tqdm(total=config.num_requests, desc="requests", unit="req", disable=not progress) as bar:
            start = time.perf_counter()
            results = await _send_all(session, config, model, bar)
            duration = time.perf_counter() - start
        after = await _scrape(session, config.metrics_url)
    return BenchRun(config, model, results, duration, before, after)


async def _first_model(session: aiohttp.ClientSession, api_base: str) -> str:
    try:
        async with session.get(api_base + "/models") as response:
            body = await response.json(content_type=None) if response.status == 200 else None
    except (aiohttp.ClientError, ValueError) as e:
        raise ColibriError(f"cannot list the models of {api_base}: {e}") from None
    if not body or not body.get("data"):
        raise ColibriError(f"{api_base}/models lists no model; pass --model")
    return body["data"][0]["id"]


async def _scrape(session: aiohttp.ClientSession, url: str) -> str | None:
    """The Prometheus text at `url`, or None when the server has no metrics there."""
    try:
        async with session.get(url) as response:
            return await response.text() if response.status == 200 else None
    except aiohttp.ClientError:
        return None


async def _send_all(session: aiohttp.ClientSession, config: BenchConfig, model: str, bar: tqdm
                    ) -> list[RequestResult]:
    limit = asyncio.Semaphore(config.concurrency) if config.concurrency else contextlib.nullcontext()
    rng = random.Random(config.seed)
    start = time.perf_counter()
    arrival = 0.0  # seconds after start
    tasks = []

    async def one(index: int) -> RequestResult:
        async with limit:
            result = await _send(session, config, model, config.prompts[index % len(config.prompts)])
        bar.update()
        return result

    for index in range(config.num_requests):
        if config.request_rate:
            arrival += rng.expovariate(config.request_rate)
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        tasks.append(asyncio.create_task(one(index)))
    return list(await asyncio.gather(*tasks))


def _body(config: BenchConfig, model: str, prompt: str | list[int]) -> dict:
    body = {"model": model, "max_tokens": config.output_len, "temperature": config.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _send(session: aiohttp.ClientSession, config: BenchConfig, model: str, prompt: str | list[int]
                ) -> RequestResult:
    path = "/chat/completions" if config.endpoint == "chat" else "/completions"
    start = time.perf_counter()
    result = RequestResult(status="")  # set once the server answers or the request fails
    try:
        async with session.post(config.api_base + path, data=orjson.dumps(_body(config, model, prompt)),
                                headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=config.timeout)) as response:
            result.status = str(response.status)
            if response.status != 200:
                result.error = (await response.text())[:500]
            else:
                await _read_stream(response, result, start, config.endpoint == "chat")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.status, result.error = type(e).__name__, str(e)
    result.latency = time.perf_counter() - start
    return result


async def _read_stream(response: aiohttp.ClientResponse, result: RequestResult, start: float, chat: bool) -> None:
    """Time the content chunks of an SSE stream and take the usage from its last chunk."""
    async for line in response.content:
        if not line.startswith(b"data:"):
            continue  # blank separators, comments (keep-alives), other fields
        data = line[len(b"data:"):].strip()
        if data == b"[DONE]":
            return
        chunk = orjson.loads(data)
        if "error" in chunk:
            result.status, result.error = "stream_error", str(chunk["error"])[:500]
            return
        if chunk.get("usage"):
            result.prompt_tokens = chunk["usage"].get("prompt_tokens")
            result.output_tokens = chunk["usage"].get("completion_tokens")
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if content:
                result.chunk_times.append(time.perf_counter() - start)
                break
    result.status, result.error = "stream_error", "the stream ended without data: [DONE]"
