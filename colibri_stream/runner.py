"""One model step: a SchedulerOutput becomes a ForwardBatch, the model computes logits, the sampler picks tokens.

`execute` runs a step and returns its tokens. `launch` and `collect` split a step whose tokens need nothing but
the logits (greedy) and a uniform (draws over the whole vocabulary) in two, so the engine can schedule and launch
the next step before it reads this one's tokens (scheduler.schedule_next): on the GPU the step is a decode graph,
or a step of prompt chunks beside decode tokens queued launch by launch on the graphs' stream, and its tokens stay
on the device, where the next step takes them from (cuda_graph.py); on the host `launch` computes the step at once
and keeps its tokens for the next.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .model import ForwardBatch, MoETransformer, PagedKVCache
from .batch import flat_batch
from .errors import ColibriError
from .exact_softmax import uniform_bits
from .request import Logprob, Request, SamplingParams, SeqId
from .sampling import (NON_FINITE_LOGITS, HostLogits, LogitSource, Sampler, SamplingState, TokenLogprobs,
                       argmax_only, drawn_over_vocabulary, token_logprobs)
from .scheduler import ScheduledSeq, SchedulerOutput
from .structured import Constraints


@dataclass
class RunnerOutput:
    """The tokens sampled by one step, one per scheduled sequence with `sample` set, in schedule order."""

    token_ids: list[int]  # -1 for a failed sequence
    logprobs: list[Logprob | None]  # None where the request did not ask for logprobs
    # (scheduled sequence's index, logprobs of the prompt tokens its chunk computed, the next ones in order) for
    # requests that asked for prompt logprobs
    prompt_logprobs: list[tuple[int, list[Logprob]]] = field(default_factory=list)
    # scheduled sequence's index -> why it failed alone (its grammar, its sampling, its logits not finite); its
    # request is to end with that error, the step's other sequences are unaffected
    failures: dict[int, str] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step launched ahead of its tokens: `ids()` waits for them, one per sampling sequence.  # [N] int64"""

    step: SchedulerOutput
    rows: list[int]  # [N] the scheduled index of each sampling sequence
    states: list[SamplingState]  # [N] their sampling states
    ids: Callable[[], np.ndarray]
    failures: dict[int, str] = field(default_factory=dict)  # as RunnerOutput's (host launches)


def build_batch(seqs: list[ScheduledSeq], block_size: int) -> ForwardBatch:
    """The flat varlen batch of a step: every sequence's chunk end to end, logits for the sampling ones."""
    sliding = None if seqs[0].sliding_block_ids is None else [s.sliding_block_ids for s in seqs]
    return flat_batch([s.token_ids for s in seqs], [s.start_position for s in seqs], [s.block_ids for s in seqs],
                      [s.sample for s in seqs], block_size, sliding)


class ModelRunner:
    """Runs steps of one model over its paged KV cache and keeps each sequence's sampling state.

    A sequence's state (its seeded generator and history) lives from its first scheduled step until the
    scheduler reports it finished, so a preempted sequence resumes drawing from the same generator.
    """

    def __init__(self, model: MoETransformer, kv_cache: PagedKVCache, max_blocks_per_seq: int | None = None,
                 max_batch_size: int | None = None, cuda_graphs: bool = True):
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = Sampler()
        self.constraints: Constraints | None = None  # grammars over the engine's tokenizer (structured output)
        self._states: dict[SeqId, SamplingState] = {}
        self._host_feedback = np.zeros(0, np.int64)  # [N] the last step launched on the host: its argmaxes
        self.graphs = None  # decode steps as CUDA graphs, where the model's work is fixed by shapes
        if cuda_graphs and max_blocks_per_seq is not None and max_batch_size is not None:
            from .cuda_graph import DecodeGraphs

            if DecodeGraphs.usable(model, kv_cache):
                self.graphs = DecodeGraphs(model, kv_cache, max_blocks_per_seq, max_batch_size)

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        for seq_id in step.finished_seq_ids:
            self._states.pop(seq_id, None)
        timer = self.model.timer
        with timer.phase("prepare"):
            batch = build_batch(step.seqs, self.kv_cache.block_size)
            prompt_rows = _prompt_rows(step.seqs)
            sampling_rows = len(batch.logits_indices)
            if prompt_rows:  # their rows' logits after the sampling rows'
                batch.logits_indices = np.concatenate([batch.logits_indices, *(rows for _, rows, _ in prompt_rows)])
        with timer.phase("forward"):
            logits, prompt_logits = self._forward(batch, sampling_rows)  # [N, V], [M, V] on the host
        failures: dict[int, str] = {}
        prompt = _prompt_logprobs(step.seqs, prompt_rows, prompt_logits, failures)
        sampling = [i for i, s in enumerate(step.seqs) if s.sample]  # [N] the scheduled index of each row
        if not sampling:
            return RunnerOutput([], [], prompt, failures)
        states = [self._state_or_failure(step.seqs[i], i, failures) for i in sampling]
        with timer.phase("sample"):
            sampled = self.sampler.sample_from(logits, states)
        failures.update((sampling[row], reason) for row, reason in sampled.failures.items())
        token_ids = sampled.token_ids.tolist()
        for index, state, token in zip(sampling, states, token_ids):
            if index in failures:
                continue
            state.output_token_ids.append(token)
            if state.constraint is not None:
                try:
                    state.constraint.accept(token)
                except ColibriError as error:  # the grammar's failure, this sequence's alone
                    failures[index] = str(error)
        for row, index in enumerate(sampling):
            if index in failures:
                token_ids[row] = -1
        return RunnerOutput(token_ids, [_logprob(token, lp) for token, lp in zip(token_ids, sampled.logprobs)],
                            prompt, failures)

    def launches(self, request: Request) -> bool:
        """Whether a launched step can compute `request`'s sequence: its token needs nothing but the logits
        (greedy) or a uniform (a draw over the whole vocabulary: no top-k, top-p, min-p, logprobs, penalties or
        bias), and no logits of its prompt are wanted."""
        params = request.params
        return request.prompt_logprobs is None and (
            argmax_only(params) or drawn_over_vocabulary(params, self.model.config.vocab_size))

    @property
    def max_tokens_ahead(self) -> int | None:
        """The most tokens a step launched on the device may hold (the larger ones wait for the host between
        layers); None where there is no such bound."""
        if self.graphs is None:
            return None
        return self.model.backend.max_tokens_in_stream_order(self.model.config)

    def launch(self, step: SchedulerOutput) -> LaunchedStep | None:
        """Start `step` without waiting for its tokens, when it can run so: every sequence is one `launches`
        takes, its prompt chunk or its one decode token, and on the GPU the step fits a decode graph or, launched
        eagerly on the graphs' stream, holds at most `max_tokens_ahead` tokens. None otherwise (`execute` it).
        Sequences with a `feed_row` take their token from the previous launched step's tokens; a step scheduled
        that way (`schedule_next` after a launched step) is always launched. A sampled sequence's uniform is
        drawn here, one a step as `execute` draws it."""
        seqs = step.seqs
        rows = [index for index, seq in enumerate(seqs) if seq.sample]  # [N] the scheduled index of each row
        if not rows or not all(self.launches(seq.request) for seq in seqs):
            return None
        if self.model.backend.supports_graphs and self.graphs is None:
            return None  # its tokens would go through the host
        timer = self.model.timer
        with timer.phase("prepare"):
            batch = build_batch(seqs, self.kv_cache.block_size)
            feed_rows = np.concatenate([np.full(len(s.token_ids), s.feed_row, np.int64) for s in seqs])  # [T]
        graphed = self.graphs is not None and self.graphs.fits(batch)
        limit = self.max_tokens_ahead
        if self.graphs is not None and not graphed and limit is not None and batch.num_tokens > limit:
            return None  # launched eagerly, its layers would wait for the host
        for seq_id in step.finished_seq_ids:
            self._states.pop(seq_id, None)
        states = [self._state(seqs[index]) for index in rows]
        failures: dict[int, str] = {}  # the host's sampler reports them; a device step's tokens stay on the device
        if self.graphs is not None:
            sampled = [not argmax_only(state.params) for state in states]  # [N]
            temperature = np.array([state.params.temperature if s else 0.0 for state, s in zip(states, sampled)],
                                   dtype=np.float32)  # [N]
            draws = uniform_bits(np.array([state.generator.random() if s else 0.0
                                           for state, s in zip(states, sampled)]))  # [N]
            if graphed:
                ids = self.graphs.launch(batch, feed_rows, temperature, draws).wait
            else:
                with timer.phase("forward"), timer.paused_device():  # its device marks would wait for it
                    ids = self.graphs.launch_eager(batch, feed_rows, temperature, draws).wait
        else:
            fed = feed_rows >= 0
            batch.token_ids[fed] = self._host_feedback[feed_rows[fed]]
            with timer.phase("forward"):
                logits = self.model.forward(batch, self.kv_cache)  # [N, V]
            with timer.phase("sample"):
                sampled = self.sampler.sample_from(HostLogits(logits), states)
            tokens = self._host_feedback = sampled.token_ids  # [N]; a failed row's -1 embeds as any token would
            ids = tokens.copy
            failures = {rows[row]: reason for row, reason in sampled.failures.items()}
        return LaunchedStep(step, rows, states, ids, failures)

    def collect(self, launched: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step's tokens."""
        with self.model.timer.phase("forward"):
            token_ids = launched.ids().tolist()
        for index, state, token in zip(launched.rows, launched.states, token_ids):
            if index not in launched.failures:
                state.output_token_ids.append(token)
        return RunnerOutput(token_ids, [None] * len(token_ids), failures=dict(launched.failures))

    def synchronize(self) -> None:
        """Wait until every launched step finished on the device (after a failure, before anything reuses their
        KV blocks)."""
        if self.graphs is not None:
            self.graphs.synchronize()

    def _forward(self, batch: ForwardBatch, sampling_rows: int) -> tuple[LogitSource, LogitSource]:
        """The step's logits of its first `sampling_rows` rows and those of the rows after them (prompt positions):
        where the backend left them (a GPU's stay there: the sampler and `token_logprobs` copy back what they need),
        from the bucket's decode graph where one fits. Returns once the device finished the step."""
        if self.graphs is not None and self.graphs.fits(batch):  # never with prompt rows (fits: one row a sequence)
            logits = self.graphs.device_logits(batch)  # one graph launch, no per-layer phases
            logits.stream.synchronize()
            return logits, HostLogits(np.zeros((0, self.model.config.vocab_size), np.float32))
        # positions stay below the model's: EngineCore bounds max_seq_len by them
        backend = self.model.backend
        every = self.model.forward_device(batch, self.model.upload_batch(batch), self.kv_cache)  # [N + M, V]
        backend.synchronize()  # the forward phase holds the device's time
        return backend.logit_source(every[:sampling_rows]), backend.logit_source(every[sampling_rows:])

    def _state_or_failure(self, seq: ScheduledSeq, index: int, failures: dict[int, str]) -> SamplingState:
        """The sequence's sampling state; where it cannot be made (its grammar refused by llguidance), the failure
        under its scheduled index and a greedy stand-in state, whose token is dropped with its request."""
        try:
            return self._state(seq)
        except ColibriError as error:
            failures[index] = str(error)
            return SamplingState.from_params(SamplingParams(temperature=0.0), ())

    def _state(self, seq: ScheduledSeq) -> SamplingState:
        request = seq.request
        state = self._states.get(request.seq_id)
        if state is None:
            state = SamplingState.from_params(request.params, request.prompt_token_ids, request.index)
            if request.params.grammar is not None:
                state.constraint = self.constraints.constraint(request.params.grammar)
            if request.params.min_tokens:
                ending = set(request.params.stop_token_ids) | (set() if request.params.ignore_eos
                                                               else set(request.eos_token_ids))
                state.ending_token_ids = tuple(t for t in sorted(ending) if t < self.model.config.vocab_size)
            self._states[request.seq_id] = state
        return state


def _prompt_rows(seqs: list[ScheduledSeq]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """For each scheduled sequence whose request wants prompt logprobs not computed yet: (its index, the flat
    batch rows whose logits predict those of its prompt tokens this chunk computes, those tokens). Position p's
    logits predict token p + 1; a chunk recomputed after a preemption adds only the ones still missing."""
    out, offset = [], 0
    for i, seq in enumerate(seqs):
        request, start, length = seq.request, seq.start_position, len(seq.token_ids)
        if request.prompt_logprobs is not None:
            first = len(request.prompt_logprobs)  # the next position whose prediction is missing
            last = min(start + length, request.num_prompt_tokens - 1)  # exclusive: the last prompt token's
            if start <= first < last:
                rows = np.arange(offset + first - start, offset + last - start, dtype=np.int64)  # [M_i]
                out.append((i, rows, np.asarray(request.token_ids[first + 1: last + 1], np.int64)))
        offset += length
    return out


def _prompt_logprobs(seqs: list[ScheduledSeq], prompt_rows: list, logits: LogitSource,
                     failures: dict[int, str]) -> list[tuple[int, list]]:
    """(sequence index, Logprobs of its prompt tokens) from the prompt rows' logits [M, V], in `prompt_rows` order;
    a sequence with a row whose logits are not finite goes to `failures` instead."""
    if not prompt_rows:
        return []
    targets = np.concatenate([t for _, _, t in prompt_rows])  # [M]
    k = max(seqs[i].request.params.prompt_logprobs for i, _, _ in prompt_rows)  # one pass: the most any row asks
    entries = [None if e is None else _logprob(int(t), e) for t, e in zip(targets, token_logprobs(logits, targets, k))]
    out, at = [], 0
    for i, rows, _ in prompt_rows:
        asked = seqs[i].request.params.prompt_logprobs
        mine = entries[at: at + len(rows)]
        at += len(rows)
        if None in mine:
            failures[i] = NON_FINITE_LOGITS
            continue
        out.append((i, [(token, logprob, top[:asked]) for token, logprob, top in mine]))
    return out


def _logprob(token: int, logprobs: TokenLogprobs | None) -> Logprob | None:
    if logprobs is None:
        return None
    return token, logprobs.logprob, list(zip(logprobs.top_token_ids.tolist(), logprobs.top_logprobs.tolist()))
