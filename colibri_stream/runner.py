"""One model step: a SchedulerOutput becomes a ForwardBatch, the model computes logits, the sampler picks tokens."""

from __future__ import annotations

from dataclasses import dataclass

from .model import ForwardBatch, MoETransformer, PagedKVCache
from .model.batch import flat_batch
from .request import Logprob, SeqId
from .sampling import HostLogits, LogitSource, Sampler, SamplingState, TokenLogprobs
from .scheduler import ScheduledSeq, SchedulerOutput


@dataclass
class RunnerOutput:
    """The tokens sampled by one step, one per scheduled sequence with `sample` set, in schedule order."""

    token_ids: list[int]
    logprobs: list[Logprob | None]  # None where the request did not ask for logprobs


def build_batch(seqs: list[ScheduledSeq], block_size: int) -> ForwardBatch:
    """The flat varlen batch of a step: every sequence's chunk end to end, logits for the sampling ones."""
    return flat_batch([s.token_ids for s in seqs], [s.start_position for s in seqs], [s.block_ids for s in seqs],
                      [s.sample for s in seqs], block_size)


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
        self._states: dict[SeqId, SamplingState] = {}
        self.graphs = None  # decode steps as CUDA graphs, where the model's work is fixed by shapes
        if cuda_graphs and max_blocks_per_seq is not None and max_batch_size is not None:
            from .backends.cuda_graph import DecodeGraphs

            if DecodeGraphs.usable(model):
                self.graphs = DecodeGraphs(model, kv_cache, max_blocks_per_seq, max_batch_size)

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        for seq_id in step.finished_seq_ids:
            self._states.pop(seq_id, None)
        timer = self.model.timer
        with timer.phase("prepare"):
            batch = build_batch(step.seqs, self.kv_cache.block_size)
        with timer.phase("forward"):
            logits = self._forward(batch)  # [N, V]
        states = [self._state(s) for s in step.seqs if s.sample]
        if not states:
            return RunnerOutput([], [])
        with timer.phase("sample"):
            sampled = self.sampler.sample_from(logits, states)
        token_ids = sampled.token_ids.tolist()
        for state, token in zip(states, token_ids):
            state.output_token_ids.append(token)
        return RunnerOutput(token_ids, [_logprob(token, lp) for token, lp in zip(token_ids, sampled.logprobs)])

    def _forward(self, batch: ForwardBatch) -> LogitSource:
        """The step's logits: on the host with NumPy; on the GPU left there (the sampler copies back what it needs),
        from the bucket's decode graph where one fits. Returns once the device finished the step."""
        if self.model.backend.name != "cupy":
            return HostLogits(self.model.forward(batch, self.kv_cache))
        from .backends.cupy_sampling import DeviceLogits

        if self.graphs is not None and self.graphs.fits(batch):
            logits = self.graphs.device_logits(batch)  # one graph launch, no per-layer phases
        else:  # positions stay below the model's: EngineCore bounds max_seq_len by them
            logits = DeviceLogits(self.model.forward_device(batch, self.model.upload_batch(batch), self.kv_cache),
                                  self.model.backend)
        logits.stream.synchronize()  # the forward phase holds the device's time, as the host path's copy does
        return logits

    def _state(self, seq: ScheduledSeq) -> SamplingState:
        request = seq.request
        state = self._states.get(request.seq_id)
        if state is None:
            state = SamplingState.from_params(request.params, request.prompt_token_ids, request.index)
            self._states[request.seq_id] = state
        return state


def _logprob(token: int, logprobs: TokenLogprobs | None) -> Logprob | None:
    if logprobs is None:
        return None
    return token, logprobs.logprob, list(zip(logprobs.top_token_ids.tolist(), logprobs.top_logprobs.tolist()))
