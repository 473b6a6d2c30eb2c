"""Iteration-level scheduling: which tokens of which sequences the next model step computes.

There is no prefill or decode phase. Every sequence has `num_computed_tokens`; each step hands out a token budget,
first to the running sequences in the order they were admitted, then to waiting ones. A prompt longer than what
is left of the budget is computed in chunks over several steps. Only the most recently admitted running sequence
can still be in its prompt (a waiting one is admitted only when the running ones got all the tokens they asked
for), so decodes come first in every step and are never starved by a long prompt.

Scheduling one step ahead (`schedule_next`): while a step whose every sequence samples is still on the device,
the next one is scheduled as if every sequence of it goes on, each taking the token the running step samples for
it (`ScheduledSeq.feed_row`), and waiting sequences the runner can take ahead are admitted beside them, their
prompts known. A sequence that the running step finishes (eos, a stop string) or that is aborted meanwhile wastes
its row of the next step, whose token for it is dropped (`update_from_output`). Anything else (a prompt going on
in chunks, a block to free by preemption) waits for a step scheduled with every token known.

When a sequence needs a KV block and none is free, the most recently admitted running sequence is preempted: its
blocks are freed and it goes back to the front of the waiting queue, keeping the tokens it generated, which are
recomputed when it is resumed (recompute, no swapping). A model's sliding-window layers keep a second table per
sequence (kv_cache.py); allocating a step lets go of its blocks before the window the step reads.

This module is the only place where a request's status, tokens and `num_computed_tokens` change.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .config import SchedulerConfig
from .errors import ConfigError
from .kv_cache import CachedPrefix, KVCacheManager
from .sliding_blocks import sliding_blocks_per_seq
from .request import Request, RequestStatus, SeqId, check_length


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: compute `token_ids` at positions `start_position` onwards."""

    request: Request
    token_ids: list[int]  # the chunk computed this step
    start_position: int  # position of token_ids[0] in the sequence (= its num_computed_tokens)
    block_ids: list[int]  # the sequence's whole block table once this step's tokens are written
    sample: bool  # the chunk reaches the sequence's last token, so the step samples its next token
    feed_row: int = -1  # >= 0: token_ids is [FED_TOKEN], the token the step before samples in this row of its ids
    # the sliding-window layers' table, as long as block_ids (released blocks: the placeholder); None without them
    sliding_block_ids: list[int] | None = None


FED_TOKEN = -1  # the token of a ScheduledSeq with a feed_row: not known on the host when the step is launched


@dataclass
class SchedulerOutput:
    """The only thing the runner learns from the scheduler about a step."""

    seqs: list[ScheduledSeq]
    num_batched_tokens: int
    preempted: list[Request] = field(default_factory=list)  # sequences that lost their blocks this step
    finished_seq_ids: list[SeqId] = field(default_factory=list)  # finished since the last step: drop their state


@dataclass
class SeqUpdate:
    """What one step did to one sequence that sampled a token."""

    request: Request
    new_token_ids: list[int]
    finished: bool
    row: int  # the sequence's index among the step's sampled tokens


class Scheduler:
    """Waiting and running queues over a KV cache manager; `schedule()` and `update_from_output()` alternate."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        if config.max_seq_len is None:
            raise ValueError("the scheduler needs a resolved max_seq_len")
        if kv.blocks_for(config.max_seq_len) > kv.num_blocks:
            raise ConfigError(f"the KV cache ({kv.num_blocks} blocks of {kv.block_size} tokens) cannot hold one "
                              f"sequence of max_seq_len {config.max_seq_len}: give it more memory or lower "
                              f"max_seq_len")
        sliding = kv.sliding
        if sliding is not None:
            step = min(config.max_seq_len, config.max_num_batched_tokens)
            need = min(kv.blocks_for(config.max_seq_len), sliding_blocks_per_seq(sliding.window, kv.block_size, step))
            if need > sliding.pool.num_blocks:
                raise ConfigError(f"the sliding-window layers' KV pool ({sliding.pool.num_blocks} blocks of "
                                  f"{kv.block_size} tokens) cannot hold one sequence's window and step ({need} "
                                  f"blocks)")
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[SeqId, Request] = {}  # every unfinished sequence
        self.num_preemptions = 0
        # Tokens admitted sequences took from the prefix cache, and those they had to compute (the prompt; after a
        # preemption the output so far too): counted at every admission.
        self.num_cached_prefill_tokens = 0
        self.num_computed_prefill_tokens = 0
        self._finished_seq_ids: list[SeqId] = []

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def check_length(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """Admission check (safe from any thread): raises PromptTooLongError; returns the output token limit."""
        return check_length(prompt_tokens, max_tokens, self.max_seq_len)

    def add_request(self, request: Request) -> None:
        """Queue a sequence; its prompt and max_tokens must fit max_seq_len (PromptTooLongError otherwise)."""
        if request.seq_id in self.requests:
            raise ValueError(f"sequence {request.seq_id} is already scheduled")
        request.max_tokens = self.check_length(request.num_prompt_tokens, request.params.max_tokens)
        self.requests[request.seq_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens; allocates their KV slots, preempting when blocks run out."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Request] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, request.num_computed_tokens + num_new, preempted):
                break
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            index += 1

        if not preempted:
            budget = self._admit(budget, scheduled)
        finished, self._finished_seq_ids = self._finished_seq_ids, []
        return SchedulerOutput(scheduled, self.config.max_num_batched_tokens - budget, preempted, finished)

    def _admit(self, budget: int, scheduled: list[ScheduledSeq],
               admissible: Callable[[Request], bool] | None = None) -> int:
        """Admit waiting sequences in order while the budget, the batch size and the KV cache allow (and each is
        `admissible`), appending their first chunks to `scheduled`; returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            request = self.waiting[0]
            if self._sibling_computing_prompt(request):
                break  # admitted once the sibling's prompt blocks are cached, it computes only the rest
            if admissible is not None and not admissible(request):
                break
            # never the last token (it needs logits), nor any prompt token whose logprob is still wanted
            prefix = (CachedPrefix() if self._wants_prompt_logits(request)
                      else self.kv.find_cached_prefix(request.token_ids))
            num_cached = prefix.num_tokens(self.kv.block_size)
            num_new = min(request.num_tokens - num_cached, budget)
            if self.kv.allocate_slots(request.seq_id, num_cached + num_new, prefix, num_cached) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens is None:  # the first admission is what the request's usage reports
                request.num_cached_tokens = num_cached
            self.num_cached_prefill_tokens += num_cached
            self.num_computed_prefill_tokens += request.num_tokens - num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return budget

    def schedule_next(self, running: SchedulerOutput, admissible: Callable[[Request], bool] | None = None,
                      max_tokens: int | None = None) -> SchedulerOutput | None:
        """The step after `running`, scheduled before its tokens are known: one token for every running sequence,
        the one `running` samples for it (`feed_row`), then the first chunks of waiting sequences that are
        `admissible` (none without it), while the step holds at most `max_tokens` tokens in all (the token budget
        when None; the decode tokens alone are bounded by the budget). None when that is not the step `schedule()`
        would give once they are known: a running sequence does not sample in `running` (its prompt goes on in
        chunks), the waiting sequence next in line is not admissible or finds no room within `max_tokens`, the
        budget is short, or a KV block is missing (preemption waits for known tokens)."""
        decoding = {seq.request.seq_id: row for row, seq in enumerate(s for s in running.seqs if s.sample)}
        computing = {seq.request.seq_id: len(seq.token_ids) for seq in running.seqs}  # tokens `running` computes
        budget = self.config.max_num_batched_tokens
        admitting = bool(self.waiting) and len(self.running) < self.config.max_batch_size
        if (len(self.running) > budget or any(r.seq_id not in decoding for r in self.running)
                or (admitting and (admissible is None or not admissible(self.waiting[0])))):
            return None
        seqs = []
        for request in self.running:
            if request.num_output_tokens + 1 >= request.max_tokens:
                continue  # the running step's token is its last
            position = request.num_computed_tokens + computing[request.seq_id]  # the running step computes those
            # only the sliding blocks before the running step's window go: it reads the others, and those it
            # completes are registered in the prefix cache once its tokens are known
            if self.kv.allocate_slots(request.seq_id, position + 1, num_computed=request.num_computed_tokens) is None:
                return None
            seqs.append(ScheduledSeq(request, [FED_TOKEN], position, list(self.kv.block_ids(request.seq_id)), True,
                                     decoding[request.seq_id], self._sliding_block_ids(request)))
        if admitting and seqs:  # a step launched ahead samples a token the next one feeds on
            room = budget if max_tokens is None else min(budget, max_tokens)
            if room <= len(seqs) < budget:
                return None  # schedule() admits the waiting prompt, a step ahead has no room for it
            self._admit(room - len(seqs), seqs, admissible)
        if not seqs:
            return None
        finished, self._finished_seq_ids = self._finished_seq_ids, []
        return SchedulerOutput(seqs, sum(len(seq.token_ids) for seq in seqs), [], finished)

    def update_from_output(self, output: SchedulerOutput, sampled: list[int]) -> list[SeqUpdate]:
        """Advance the scheduled sequences; `sampled` holds one token per sequence with `sample` set, in order.
        Sequences that finished after the step was scheduled (scheduled one step ahead) are skipped.

        Applies the stop conditions the scheduler can see (stop token ids, eos, max_tokens, max_seq_len); stop
        strings are found by the detokenizer and reported through `finish`.
        """
        if len(sampled) != sum(seq.sample for seq in output.seqs):
            raise ValueError(f"{len(sampled)} sampled tokens for {sum(s.sample for s in output.seqs)} sequences")
        row = 0
        updates = []
        for seq in output.seqs:
            request = seq.request
            if request.status.finished:
                row += seq.sample
                continue
            request.num_computed_tokens += len(seq.token_ids)
            self.kv.cache_blocks(request.seq_id, request.token_ids, request.num_computed_tokens)
            if not seq.sample:
                continue
            token = sampled[row]
            request.token_ids.append(token)
            status = self._stop_status(request, token)
            if status is not None:
                self._finish(request, status, token if token in request.params.stop_token_ids else None)
            updates.append(SeqUpdate(request, [token], status is not None, row))
            row += 1
        return updates

    def finish(self, seq_ids: Iterable[SeqId], status: RequestStatus, stop_reason: str | int | None = None) -> None:
        """Finish sequences from outside a step (abort, stop string); unknown or finished ones are ignored."""
        for seq_id in seq_ids:
            request = self.requests.get(seq_id)
            if request is not None:
                self._finish(request, status, stop_reason)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        return ScheduledSeq(request, request.token_ids[start:start + num_new], start,
                            list(self.kv.block_ids(request.seq_id)), start + num_new == request.num_tokens,
                            sliding_block_ids=self._sliding_block_ids(request))

    def _sliding_block_ids(self, request: Request) -> list[int] | None:
        table = self.kv.sliding_block_ids(request.seq_id)
        return None if table is None else list(table)

    def _allocate_or_preempt(self, request: Request, num_tokens: int, preempted: list[Request]) -> bool:
        """Give `request` slots for `num_tokens` tokens, preempting the latest admitted running sequences until
        they fit; False when that meant preempting `request` itself."""
        while self.kv.allocate_slots(request.seq_id, num_tokens, num_computed=request.num_computed_tokens) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _sibling_computing_prompt(self, request: Request) -> bool:
        """Whether another sequence of `request`'s request (n > 1) is running and has not computed the prompt
        blocks `request` could take from the prefix cache yet: waiting for it saves computing the prompt again."""
        if not self.kv.enable_prefix_caching or self._wants_prompt_logits(request):
            return False
        shareable = (request.num_prompt_tokens - 1) // self.kv.block_size * self.kv.block_size
        return shareable > 0 and any(other.request_id == request.request_id and other.num_computed_tokens < shareable
                                     for other in self.running)

    @staticmethod
    def _wants_prompt_logits(request: Request) -> bool:
        """Whether `request` still needs logits at prompt positions (its prompt logprobs are not all computed)."""
        return request.prompt_logprobs is not None and len(request.prompt_logprobs) < request.num_prompt_tokens - 1

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.seq_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in request.eos_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:  # admission capped max_tokens at what max_seq_len leaves
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus, stop_reason: str | int | None) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        request.stop_reason = stop_reason
        self.kv.free(request.seq_id)
        del self.requests[request.seq_id]
        self._finished_seq_ids.append(request.seq_id)
