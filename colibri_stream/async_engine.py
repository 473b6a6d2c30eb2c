"""`AsyncEngine`: the asyncio face of an `EngineCore`, whose step loop runs on a thread or in an engine process.

Requests and aborts reach the step loop (`engine_loop.py`) as commands; each step's outputs come back to
per-request collectors on the event loop. The engine process (`engine_process.py`) is the same loop in a child.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

from .checkpoint import default_model_path
from .config import EngineConfig, ModelConfig
from .engine import EngineCore, EngineStats
from .engine_loop import AbortRequest, AddRequest, Command, LoopEnded, StepReport, StopLoop, run_step_loop
from .engine_process import EngineProcess
from .errors import (ConfigError, EngineStepError, EngineStoppedError, InvalidParameterError, QueueFullError,
                     describe)
from .expert_group import ExpertParallelProcess
from .experts.stats import ExpertStats
from .request import RequestOutput, SamplingParams
from .request_checks import RequestChecks
from .timing import StepSink
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)


ENCODE_INLINE_CHARS = 8192  # texts of up to this many characters (or token ids) are encoded on the event loop


def _encodes_inline(prompt: str | list[int] | list[dict]) -> bool:
    """Whether a prompt is encoded on the event loop (microseconds): a short text or token id list. Chats render on
    a worker thread whatever their size, as a template's cost follows no one count (messages, content, tools)."""
    return len(prompt) <= ENCODE_INLINE_CHARS and not any(isinstance(item, dict) for item in prompt[:1])


class _Collector:
    """The mailbox between the step thread and one `generate()` call, living on the event loop.

    Outputs the consumer has not taken yet are merged per sequence (`RequestOutput.merge`), so a slow consumer
    holds one pending output per sequence instead of a growing queue.
    """

    def __init__(self) -> None:
        self._pending: dict[int, RequestOutput] = {}  # sequence index -> merged outputs, oldest first
        self._waiter: asyncio.Future | None = None  # while the consumer waits for an output
        self._error: BaseException | None = None

    def put(self, out: RequestOutput) -> None:
        previous = self._pending.get(out.index)
        self._pending[out.index] = out if previous is None else previous.merge(out)
        self._wake()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while not self._pending:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._pending.pop(next(iter(self._pending)))


class AsyncEngine:
    """The asyncio face of the engine: `generate()` streams RequestOutputs, `abort()` cancels a request.

    Use it as `async with AsyncEngine.from_pretrained(path) as engine:`. The step loop (`engine_loop.py`) runs on
    a thread of this process, or with engine_process=True in a child process of its own (`engine_process.py`),
    so that this process's Python does not share a GIL with the steps; either way the event loop never waits
    for the model, prompts are tokenized and requests validated here, and the loop sleeps when there is no work.
    Requests and aborts reach the loop as commands applied between steps; each step's outputs come back in one
    message, handed to the per-request collectors with one `call_soon_threadsafe`. Stopping a `generate()`
    iteration early (break and aclose, task cancellation) aborts the request and frees its KV blocks.

    Latency: every RequestOutput carries `time_to_first_token` (on the output with a sequence's first token) and
    `inter_token_latencies` (per later token), measured where the step ran when the tokens were sampled, so a
    consumer that lags does not distort them; `stats()` is the engine-wide snapshot for monitoring.
    """

    def __init__(self, core: EngineCore):
        """Step `core` on a thread of this process."""
        self._core = core
        self._setup(core.config, core, _StepThread(core), core.stats())

    def _setup(self, config: EngineConfig, checks: EngineCore | RequestChecks, transport: _StepThread | EngineProcess,
               stats: EngineStats) -> None:
        self._config = config
        self._checks = checks  # encodes and validates prompts: in-process the core itself (it delegates to its own)
        self._transport = transport
        self.tokenizer: Tokenizer = checks.tokenizer
        self.model_config: ModelConfig = checks.model_config
        self.model_name = Path(config.model).resolve().name
        self.max_seq_len: int = checks.max_seq_len
        self._collectors: dict[str, _Collector] = {}
        self._stats = stats
        self._num_sent = 0  # sequences sent to the step loop
        self._num_applied = 0  # of which the step loop had queued at the last snapshot
        self._abort_acks: dict[int, asyncio.Future] = {}  # AbortRequest ack -> resolved once its blocks are free
        self._ack_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._loop_done: asyncio.Future | None = None
        self._accepting = False
        self._last_step_failed = False  # set and cleared on the event loop, in step order

    @classmethod
    def from_pretrained(cls, path: str | None = None, engine_process: bool = False,
                        process_env: dict[str, str] | None = None, expert_parallel: int = 1,
                        **config: Any) -> AsyncEngine:
        """Load a model folder (None: the model shipped with Colibri). engine_process: run the steps in a child
        process (spawned; this process never touches the device), else on a thread of this one. Options:
        max_batch_size, max_num_batched_tokens, max_seq_len, kv_cache_memory (bytes) or num_kv_blocks (default:
        sized from free memory, docs/KV_CACHE.md), gpu_memory_utilization (default 0.9), kv_cache_dtype (auto |
        bf16 | fp16 | fp8 | fp32), block_size, enable_prefix_caching (default True), max_queue (0: unbounded),
        device ("cpu" | "auto"), verify, cuda_graphs (default True: decode steps replayed as CUDA graphs on the
        GPU). process_env: environment variables of the engine process (with engine_process only).
        expert_parallel: ranks the routed experts are sharded over, each in a process of its own
        (expert_group.py; with engine_process only)."""
        if process_env and not engine_process:
            raise ValueError("process_env needs engine_process=True")
        if expert_parallel != 1 and not engine_process:
            raise ConfigError("expert-parallel ranks run in engine processes of their own; drop --no-engine-process "
                              "or use --expert-parallel 1")
        if not engine_process:
            return cls(EngineCore.from_pretrained(path, **config))
        engine_config = EngineConfig.from_options(str(default_model_path()) if path is None else str(path), **config)
        # each raises what loading the model raised
        process = (EngineProcess(path, config, process_env) if expert_parallel == 1
                   else ExpertParallelProcess(path, config, expert_parallel, process_env))
        try:
            ready = process.ready
            tokenizer = Tokenizer.from_folder(engine_config.model)
            eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(ready.model_config.eos_token_ids)
            checks = RequestChecks(tokenizer, ready.model_config, ready.max_seq_len, eos_token_ids)
        except BaseException:
            process.close()
            raise
        engine = cls.__new__(cls)
        engine._setup(engine_config, checks, process, ready.stats)
        return engine

    @property
    def pid(self) -> int:
        """The id of the process that runs the steps."""
        return self._transport.pid

    async def start(self) -> None:
        """Start the step loop, publishing to the running loop."""
        if self._running:
            return
        loop = self._loop = asyncio.get_running_loop()
        self._num_sent = self._num_applied = 0
        self._loop_done = loop.create_future()
        self._running = self._accepting = True
        self._transport.start_loop(lambda message: loop.call_soon_threadsafe(self._on_message, message))

    async def stop(self, drain: bool = True) -> None:
        """Refuse new requests, then finish (drain) or abort the running ones and end the step loop."""
        if not self._running:
            return
        self._accepting = False
        if not self._loop_done.done():
            self._transport.send(StopLoop(drain))
        await self._loop_done
        self._transport.join_loop()
        self._running = False
        for collector in self._collectors.values():
            collector.fail(EngineStoppedError("the engine stopped"))

    async def close(self) -> None:
        """Stop (draining), then close the engine core (`EngineCore.close`, in the child process where it runs
        there, which is then joined): when this returns, every thread and process the engine started has been
        joined."""
        await self.stop()
        self._transport.close()
        self._checks.close()  # in-process the core, closed already (a second close does nothing)

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def encode(self, prompt: str | list[int] | list[dict], add_special_tokens: bool = True,
                     tools: list[dict] | None = None, template_kwargs: dict | None = None,
                     keep_last: int | None = None, fit_context: bool = True) -> list[int]:
        """The prompt's token ids (`RequestChecks.encode_prompt`: a prompt that cannot fit is refused before it is
        tokenized whole, unless `keep_last` or fit_context=False). Chats and long prompts are encoded on a worker
        thread, where the tokenizer runs without the GIL: tokenizing a few MiB of text takes seconds, which would
        stall every stream on this event loop."""
        args = (prompt, add_special_tokens, tools, template_kwargs, keep_last, fit_context)
        if _encodes_inline(prompt):
            return self._checks.encode_prompt(*args)
        return await asyncio.get_running_loop().run_in_executor(None, self._checks.encode_prompt, *args)

    async def check_grammar(self, grammar: str) -> None:
        """Check a grammar against the tokenizer on a worker thread (seconds for a large one with a large
        vocabulary); `generate` then finds its verdict at once. Raises InvalidParameterError like `generate`."""
        await asyncio.get_running_loop().run_in_executor(None, self._checks.check_grammar, grammar)

    async def generate(self, prompt: str | list[int] | list[dict], params: SamplingParams,
                       request_id: str | None = None, add_special_tokens: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until each of its params.n sequences has finished.

        A prompt is text, token ids, or chat messages (rendered with the model's chat template). Invalid
        requests raise before the first output: InvalidParameterError, PromptTooLongError, QueueFullError,
        EngineStoppedError (and ChatTemplateError for messages the template rejects).
        """
        prompt_token_ids = self._checks.encode_prompt(prompt, add_special_tokens)
        self._checks.validate(prompt_token_ids, params)
        if not self._accepting:
            raise EngineStoppedError("the engine is not running")
        capacity = self.capacity
        if capacity is not None and params.n > capacity:
            raise InvalidParameterError(f"n={params.n} sequences can never be admitted: this server runs at most "
                                        f"{capacity} at once (max_batch_size + max_queue)", param="n")
        if self._queue_is_full(params.n):
            raise QueueFullError(f"{self._config.scheduler.max_queue} sequences are already waiting; "
                                 f"retry later")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._collectors:
            raise InvalidParameterError(f"request_id {request_id!r} is already in use", param="request_id")
        collector = _Collector()
        self._collectors[request_id] = collector
        self._transport.send(AddRequest(request_id, prompt_token_ids, params, time.monotonic()))
        self._num_sent += params.n
        finished = 0
        try:
            while finished < params.n:
                out = await collector.get()
                finished += out.finished
                yield out
        finally:
            del self._collectors[request_id]
            if finished < params.n:
                self._transport.send(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once its KV blocks are free. Unknown or finished requests are ignored."""
        if not self._running:
            return
        ack = next(self._ack_ids)
        done = self._abort_acks[ack] = self._loop.create_future()
        self._transport.send(AbortRequest(request_id, ack))
        try:
            await asyncio.wait([done, self._loop_done], return_when=asyncio.FIRST_COMPLETED)
        finally:
            del self._abort_acks[ack]

    @property
    def healthy(self) -> bool:
        """Running, and its last model step (if any since the last failure) did not fail."""
        return self._accepting and not self._last_step_failed

    def stats(self) -> EngineStats:
        """The snapshot taken after the last step (or the last batch of requests and aborts)."""
        return self._stats

    def add_step_sink(self, sink: StepSink) -> None:
        """Time every later step's phases and hand each StepRecord to `sink` (before start()), on the step
        thread, or on the thread that reads the engine process's messages."""
        self._transport.add_step_sink(sink)

    def store_stats(self) -> ExpertStats | None:
        """The expert store's counters: now in-process (taken while a step may run: a step's figures can be half
        counted), at most `engine_process.STORE_STATS_SECONDS` old from an engine process."""
        return self._transport.store_stats()

    @property
    def capacity(self) -> int | None:
        """Sequences the engine can hold at once, running and waiting (None: the queue is unbounded)."""
        config = self._config.scheduler
        return config.max_batch_size + config.max_queue if config.max_queue else None

    def _queue_is_full(self, n: int) -> bool:
        """Whether `n` more sequences would leave more than max_queue waiting once the batch's free slots fill."""
        config, stats = self._config.scheduler, self._stats
        if not config.max_queue:
            return False
        unapplied = self._num_sent - self._num_applied  # sent to the step loop after the last snapshot
        free = config.max_batch_size - stats.num_running  # batch slots the waiting sequences move into first
        return max(0, stats.num_waiting + unapplied + n - free) > config.max_queue

    # ---- on the event loop -------------------------------------------------------------------------------
    def _on_message(self, message: StepReport | LoopEnded) -> None:
        if isinstance(message, LoopEnded):
            if message.error is not None:
                self._fail_all(message.error)
            self._loop_done.set_result(None)
            return
        self._stats, self._num_applied = message.stats, message.num_applied
        if message.outputs:
            self._last_step_failed = False
        for out in message.outputs:
            collector = self._collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)
        for ack in message.acks:
            future = self._abort_acks.get(ack)
            if future is not None and not future.done():
                future.set_result(None)
        for request_id, error in message.failed.items():
            self._fail_request(request_id, error)
        if message.step_failure is not None:
            self._fail_step(message.step_failure.request_ids, message.step_failure.error)

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        collector = self._collectors.get(request_id)
        if collector is not None:
            collector.fail(error)

    def _fail_step(self, request_ids: set[str], error: BaseException) -> None:
        self._last_step_failed = True
        failure = EngineStepError(f"the model step failed: {describe(error)}")
        failure.__cause__ = error
        for request_id in request_ids:
            self._fail_request(request_id, failure)

    def _fail_all(self, error: BaseException) -> None:
        self._accepting = False
        failure = EngineStoppedError(f"the engine stopped after an error: {describe(error)}")
        failure.__cause__ = error
        for collector in self._collectors.values():
            collector.fail(failure)


class _StepThread:
    """The step loop on a thread of this process: AsyncEngine's transport without an engine process."""

    def __init__(self, core: EngineCore):
        self._core = core
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.pid = os.getpid()

    def start_loop(self, deliver: Callable[[StepReport | LoopEnded], None]) -> None:
        self._thread = threading.Thread(target=run_step_loop, args=(self._core, self._receive, deliver),
                                        name="colibri-engine", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        self._inbox.put(command)

    def join_loop(self) -> None:
        self._thread.join()
        self._thread = None

    def close(self) -> None:
        self._core.close()

    def add_step_sink(self, sink: StepSink) -> None:
        self._core.timer.add_sink(sink)

    def store_stats(self) -> ExpertStats | None:
        return self._core.store_stats()

    def _receive(self, block: bool) -> list[Command]:
        commands = [self._inbox.get()] if block else []
        while not self._inbox.empty():
            commands.append(self._inbox.get())
        return commands


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine to completion on uvloop when it is installed, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
