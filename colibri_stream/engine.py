"""The engine core: `EngineCore` steps the model synchronously (`async_engine.AsyncEngine` drives it for asyncio).

One step is schedule -> run the model and sample -> update the requests -> detokenize. `EngineCore.step` is
the only function that loops over a step's outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from .checkpoint import default_model_path
from .config import EngineConfig, ModelConfig
from .errors import EngineStepError, RequestsFailedError
from .experts.expert_parallel import Communicator
from .experts.stats import ExpertStats
from .kv_budget import (KVCacheSize, SlidingPool, activation_reserve, default_budget, size_kv_cache,
                        sliding_pool_blocks)
from .kv_cache import KVCacheManager
from .loader import load_model
from .model import MoETransformer
from .model.paged_kv import PagedKVCache, SlidingLayers, kv_bytes_per_token, resolve_kv_dtype
from .request import Logprob, Request, RequestOutput, RequestStatus, SamplingParams
from .request_checks import RequestChecks
from .runner import LaunchedStep, ModelRunner, RunnerOutput
from .scheduler import Scheduler, SchedulerOutput, SeqUpdate
from .timing import StepTimer
from .tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for monitoring (`AsyncEngine.stats()`)."""

    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences queued (new or preempted)
    kv_blocks_total: int
    kv_blocks_used: int  # held by running sequences (cached blocks nobody holds count as free)
    kv_blocks_cached: int  # holding a prefix-cache entry, held or not
    prefix_cache_hit_tokens: int  # tokens admitted sequences took from the prefix cache
    prefill_computed_tokens: int  # tokens admitted sequences had to compute
    num_steps: int
    num_steps_launched_ahead: int  # of them, launched before the step before was read (async scheduling)
    num_preemptions: int
    num_generated_tokens: int
    num_aborted: int  # sequences finished by an abort (the client left or cancelled, or shutdown)
    last_step_time: float  # seconds the last step took
    last_step_tokens: int  # tokens the last step computed (prefill chunks and decodes)
    sliding_blocks_total: int = 0  # the sliding-window layers' pool (sliding_blocks.py); 0 without one
    sliding_blocks_used: int = 0  # of them, held by sequences


@dataclass
class _Sequence:
    """The output side of one sequence: its text stream and when its last token came."""

    request: Request
    detokenizer: IncrementalDetokenizer
    last_token_time: float | None = None  # time.monotonic()


def _sliding_layers(model: MoETransformer, config: EngineConfig) -> SlidingLayers | None:
    """The layers whose KV is bounded by their window in a pool of their own (none when turned off)."""
    if not config.cache.sliding_window_pool:
        return None
    return SlidingLayers.of(model.config, config.scheduler.max_seq_len or model.config.max_position_embeddings)


def _size_kv_cache(model: MoETransformer, config: EngineConfig, sliding: SlidingLayers | None) -> KVCacheSize:
    """The KV cache's blocks (and the sliding-window layers' pool's) and the engine's max_seq_len (kv_budget.py),
    from the memory left after loading; a lowered max_seq_len is logged as a warning."""
    cfg, cache, scheduler = model.config, config.cache, config.scheduler
    dtype = resolve_kv_dtype(cache.kv_cache_dtype, cfg)
    memory = model.backend.memory_info()
    budget = default_budget(memory, cache.gpu_memory_utilization,
                            activation_reserve(cfg, scheduler.max_num_batched_tokens))
    num_sliding = 0 if sliding is None else len(sliding.layers)
    pool = None if sliding is None else SlidingPool(
        sliding_pool_blocks(sliding.window, cache.block_size, scheduler.max_batch_size,
                            scheduler.max_num_batched_tokens, cache.enable_prefix_caching),
        kv_bytes_per_token(cfg, dtype, num_sliding))
    size = size_kv_cache(cache, kv_bytes_per_token(cfg, dtype, cfg.num_layers - num_sliding),
                         cfg.max_position_embeddings, scheduler.max_seq_len, scheduler.max_batch_size, budget, pool)
    if size.warning():
        logger.warning("%s", size.warning())
    return size


def _log_kv_cache(size: KVCacheSize, kv_cache: PagedKVCache, config: ModelConfig,
                  sliding: SlidingLayers | None) -> None:
    """The start-up lines of the KV cache: its blocks, and the sliding-window layers' pool where there is one."""
    num_sliding = 0 if sliding is None else len(sliding.layers)
    full = size.capacity_tokens * kv_bytes_per_token(config, kv_cache.dtype, config.num_layers - num_sliding)
    logger.info("KV cache: %d tokens (%d blocks of %d) in %s, %.2f GiB; max_seq_len %d", size.capacity_tokens,
                size.num_blocks, size.block_size, kv_cache.dtype, full / 2**30, size.max_seq_len)
    if sliding is not None:
        tokens = (size.num_sliding_blocks + 1) * size.block_size
        logger.info("KV cache of the %d sliding-window layers (window %d): %d blocks of their own, %.2f GiB",
                    num_sliding, sliding.window, size.num_sliding_blocks,
                    tokens * kv_bytes_per_token(config, kv_cache.dtype, num_sliding) / 2**30)


class EngineCore:
    """Continuous batching over one model, driven by calling `step()`; not thread-safe (one thread drives it).

    `add_request` queues a request as `params.n` sequences, `step()` runs one model step and returns a
    RequestOutput per sequence that got a token, `abort` finishes a request at once and frees its KV blocks.
    Each output carries its latency: `time_to_first_token` (arrival to the step that produced the first token)
    and `inter_token_latencies` (time since the sequence's previous token, per later token).
    """

    def __init__(self, model: MoETransformer, tokenizer: Tokenizer, config: EngineConfig):
        config = dataclasses.replace(config, scheduler=config.scheduler.on_device(model.backend.device))
        self.config = config
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        sliding = _sliding_layers(model, config)
        self.kv_size = _size_kv_cache(model, config, sliding)
        self.max_seq_len = self.kv_size.max_seq_len
        num_blocks, block_size = self.kv_size.num_blocks, self.kv_size.block_size
        num_sliding_blocks = self.kv_size.num_sliding_blocks
        self.kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching,
                                 None if sliding is None else sliding.window, num_sliding_blocks)
        self.scheduler = Scheduler(dataclasses.replace(config.scheduler, max_seq_len=self.max_seq_len), self.kv)
        kv_cache = model.allocate_kv_cache(num_blocks, block_size, config.cache.kv_cache_dtype, sliding,
                                           num_sliding_blocks)
        _log_kv_cache(self.kv_size, kv_cache, model.config, sliding)
        self.runner = ModelRunner(model, kv_cache, -(-self.max_seq_len // block_size),
                                  config.scheduler.max_batch_size, cuda_graphs=config.cuda_graphs)
        self.timer: StepTimer = model.timer  # phases of every step; `timer.add_sink` turns it on
        self.async_scheduling = (self.runner.graphs is not None if config.async_scheduling is None
                                 else config.async_scheduling)
        self._launched: LaunchedStep | None = None  # a decode step launched ahead of its tokens
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(model.config.eos_token_ids)
        self.checks = RequestChecks(tokenizer, model.config, self.max_seq_len, self.eos_token_ids)
        self.runner.constraints = self.checks.constraints
        self._requests: dict[str, dict[int, _Sequence]] = {}  # request id -> its unfinished sequences by index
        self._num_steps = 0
        self._num_steps_launched_ahead = 0
        self._num_generated_tokens = 0
        self._num_aborted = 0
        self._last_step_time = 0.0
        self._last_step_tokens = 0
        self._closed = False

    @classmethod
    def from_pretrained(cls, path: str | None = None, *, expert_group: Communicator | None = None,
                        **options: Any) -> EngineCore:
        """Load the model folder at `path` (None: the model shipped with Colibri); `options` are
        EngineConfig.from_options' flat keys; `expert_group`: the communicator of the expert-parallel group this
        engine is a rank of (`load_model`), or None."""
        config = EngineConfig.from_options(str(default_model_path()) if path is None else str(path), **options)
        model = load_model(config.model, device=config.device, verify=config.verify, experts=config.experts,
                           max_positions=config.scheduler.max_seq_len, matmul_precision=config.matmul_precision,
                           expert_group=expert_group)
        return cls(model, Tokenizer.from_folder(config.model), config)

    def encode_prompt(self, prompt: str | list[int] | list[dict], add_special_tokens: bool = True,
                      tools: list[dict] | None = None, template_kwargs: dict | None = None,
                      keep_last: int | None = None, fit_context: bool = True) -> list[int]:
        """Token ids of a prompt: `RequestChecks.encode_prompt`."""
        return self.checks.encode_prompt(prompt, add_special_tokens, tools, template_kwargs, keep_last, fit_context)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The admission checks, callable from any thread: InvalidParameterError, PromptTooLongError."""
        self.checks.validate(prompt_token_ids, params)

    def check_grammar(self, grammar: str) -> None:
        """Raise InvalidParameterError if `grammar` cannot be used with this model's tokenizer."""
        self.checks.check_grammar(grammar)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, validated: bool = False) -> None:
        """Queue a request (as params.n sequences); raises like `validate`, or ValueError for a duplicate id.
        validated: `validate` has passed already (where the request was admitted), so its grammar is not checked
        again here; the length is, by the scheduler."""
        if not validated:
            self.validate(prompt_token_ids, params)
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = self._requests[request_id] = {}
        for index in range(params.n):
            request = Request(request_id, prompt_token_ids, params, self.eos_token_ids, index, arrival)
            self.scheduler.add_request(request)
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                 params.stop, params.include_stop_str_in_output)
            seqs[index] = _Sequence(request, detokenizer)

    def has_unfinished(self) -> bool:
        """Whether a request is unfinished or a step launched ahead is still to be collected."""
        return self.scheduler.has_unfinished() or self._launched is not None

    def step(self) -> list[RequestOutput]:
        """Run one model step; returns an output for every sequence that sampled a token.

        With async scheduling a decode step that `runner.launch` takes is launched ahead: a call launches the next
        step, then reads the tokens of the one launched by the call before (or by itself, for the first of a run of
        them).

        A failure that belongs to one request (its grammar, its sampling, logits that are not finite in its row,
        its detokenization) ends that request alone: it is aborted (its blocks freed) and the step raises
        RequestsFailedError, which carries the step's other outputs and each failed request's error; the engine
        goes on. Any other exception is the step's as a whole (the forward pass), for the caller to fail every
        request of the step."""
        if not self.has_unfinished():
            return []
        start = time.perf_counter()
        timer = self.timer
        with timer.phase("step"):
            try:
                scheduled, result = self._run_step()
            except BaseException:
                self._launched = None
                with contextlib.suppress(Exception):  # the step's own error is the one to report
                    self.runner.synchronize()  # nothing launched may still write KV blocks the failure frees
                raise
            timer.annotate(tokens=scheduled.num_batched_tokens, seqs=len(scheduled.seqs))
            for index, entries in result.prompt_logprobs:  # before the outputs: the first one carries them
                scheduled.seqs[index].request.prompt_logprobs.extend(entries)
            failed = {scheduled.seqs[index].request.request_id: reason for index, reason in result.failures.items()}
            for request_id in failed:  # before the update, which then skips their sequences
                self.abort(request_id)
            with timer.phase("update"):
                updates = self.scheduler.update_from_output(scheduled, result.token_ids)
            now = time.monotonic()
            with timer.phase("detokenize"):
                outputs = []
                for update in updates:
                    try:
                        outputs.append(self._output(update, result.logprobs[update.row], now))
                    except Exception as error:  # noqa: BLE001 - this request's, reported for it alone
                        logger.warning("detokenizing request %s failed", update.request.request_id, exc_info=True)
                        failed[update.request.request_id] = f"detokenizing failed: {error}"
                        self.abort(update.request.request_id)
        self._num_steps += 1
        self._num_generated_tokens += len(updates)
        self._last_step_time = time.perf_counter() - start
        self._last_step_tokens = scheduled.num_batched_tokens
        if failed:
            raise RequestsFailedError([out for out in outputs if out.request_id not in failed],
                                      {request_id: EngineStepError(reason) for request_id, reason in failed.items()})
        return outputs

    def _run_step(self) -> tuple[SchedulerOutput, RunnerOutput]:
        """Compute a step and return it with its tokens: the step launched ahead by the call before, else a step
        scheduled now. A launched step's successor (its decodes, and the prompts admitted beside them) is scheduled
        and launched before its tokens are read."""
        launched = self._launched
        if launched is None:
            with self.timer.phase("schedule"):
                scheduled = self.scheduler.schedule()
            launched = self.runner.launch(scheduled) if self.async_scheduling else None
            if launched is None:
                return scheduled, self.runner.execute(scheduled)
        with self.timer.phase("schedule"):
            following = self.scheduler.schedule_next(launched.step, self.runner.launches, self.runner.max_tokens_ahead)
        self._launched = None if following is None else self.runner.launch(following)
        if following is not None and self._launched is None:
            raise RuntimeError("a step scheduled ahead could not be launched")
        self._num_steps_launched_ahead += following is not None
        return launched.step, self.runner.collect(launched)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Finish every sequence of `request_id` and free its blocks; returns their final outputs."""
        seqs = self._requests.pop(request_id, {})
        self._num_aborted += len(seqs)
        self.scheduler.finish([seq.request.seq_id for seq in seqs.values()], RequestStatus.FINISHED_ABORTED)
        return [_request_output(seq.request, "", []) for seq in seqs.values()]

    def abort_all(self) -> list[RequestOutput]:
        """Abort every unfinished request."""
        return [out for request_id in list(self._requests) for out in self.abort(request_id)]

    def close(self) -> None:
        """Abort what is unfinished, wait for the device, then stop every thread the model's expert store runs and
        join it, so nothing runs compiled code while the interpreter shuts down. Nothing uses the engine after;
        a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.abort_all()
        self._launched = None
        try:
            self.runner.synchronize()
        finally:
            self.runner.constraints.close()
            self.runner.model.close()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_cached=self.kv.num_cached_blocks,
            prefix_cache_hit_tokens=self.scheduler.num_cached_prefill_tokens,
            prefill_computed_tokens=self.scheduler.num_computed_prefill_tokens,
            num_steps=self._num_steps,
            num_steps_launched_ahead=self._num_steps_launched_ahead,
            num_preemptions=self.scheduler.num_preemptions,
            num_generated_tokens=self._num_generated_tokens,
            num_aborted=self._num_aborted,
            last_step_time=self._last_step_time,
            last_step_tokens=self._last_step_tokens,
            sliding_blocks_total=0 if self.kv.sliding is None else self.kv.sliding.pool.num_blocks,
            sliding_blocks_used=0 if self.kv.sliding is None else (self.kv.sliding.pool.num_blocks
                                                                  - self.kv.sliding.pool.num_free),
        )

    def store_stats(self) -> ExpertStats | None:
        """A snapshot of the expert store's counters (None when every expert is resident)."""
        return self.runner.model.store.stats()

    def _output(self, update: SeqUpdate, logprob: Logprob | None, now: float) -> RequestOutput:
        request = update.request
        seqs = self._requests[request.request_id]
        seq = seqs[request.index]
        new_ids = update.new_token_ids
        if request.status == RequestStatus.FINISHED_STOPPED and not request.params.include_stop_str_in_output:
            new_ids = new_ids[:-1]  # the stop token's (or end of sequence's) text is not part of the output (vLLM's)
        text = seq.detokenizer.add(new_ids)
        stop_string = seq.detokenizer.stop_reason if seq.detokenizer.stopped else None
        if stop_string is not None and not request.status.finished:
            self.scheduler.finish([request.seq_id], RequestStatus.FINISHED_STOPPED, stop_string)
        elif stop_string is None and request.status.finished:
            text += seq.detokenizer.flush()
        if request.status.finished:
            del seqs[request.index]
            if not seqs:
                del self._requests[request.request_id]
        first = seq.last_token_time is None
        prompt = first and request.prompt_logprobs is not None
        out = _request_output(
            request, text, update.new_token_ids,
            logprobs=None if request.params.logprobs is None else [logprob],
            prompt_token_ids=request.prompt_token_ids if prompt else None,
            prompt_logprobs=list(request.prompt_logprobs) if prompt else None,
            time_to_first_token=now - request.arrival_time if first else None,
            inter_token_latencies=[] if first else [now - seq.last_token_time],
        )
        seq.last_token_time = now
        if stop_string is not None:  # also when the stop string came with the last token max_tokens allowed
            out.finish_reason, out.stop_reason = "stop", stop_string
        return out


def _request_output(request: Request, text: str, token_ids: list[int], **extra: Any) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        index=request.index,
        text=text,
        token_ids=token_ids,
        finished=request.status.finished,
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        prompt_tokens=request.num_prompt_tokens,
        completion_tokens=request.num_output_tokens,
        cached_tokens=request.num_cached_tokens or 0,
        **extra,
    )
