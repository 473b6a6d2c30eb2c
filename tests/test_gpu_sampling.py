"""Sampling from logits left on the GPU (backends/cupy_sampling.DeviceLogits) against NumPy (CUDA GPU).

What the device hands back must equal what NumPy computes from the same logits, bit for bit: candidate ids and
scaled logits, log-normalisers (from the integer exp sums), and so the tokens and logprobs of seeded requests.
Outputs are poisoned: the memory pool is refilled with all-ones bytes first (NaN floats, -1 integers), so an
element a kernel fails to write shows.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (GPU tests need cupy-cuda12x or cupy-cuda13x)")
if not cupy.cuda.is_available():
    pytest.skip("CuPy finds no CUDA GPU", allow_module_level=True)

from test_sampling import (  # noqa: E402
    assert_same_output,
    random_params,
    random_tied_logits,
    reference_walk,
    whole_vocabulary_logits,
    whole_vocabulary_params,
)

from colibri_stream.backends.cupy_backend import CupyBackend  # noqa: E402
from colibri_stream.backends.cupy_sampling import MAX_CANDIDATES, DeviceLogits  # noqa: E402
from colibri_stream.llm import LLM  # noqa: E402
from colibri_stream.request import SamplingParams  # noqa: E402
from colibri_stream.sampling import TOP_P_CANDIDATES, HostLogits, Sampler, SamplingState  # noqa: E402

pytestmark = pytest.mark.gpu

GPU = CupyBackend()


def poison() -> None:
    """Refill the memory pool with all-ones bytes: the next allocations are carved from it."""
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    filler = cupy.full(64 << 20, -1, dtype=np.int32)  # 256 MiB
    del filler


def special_rows(logits: np.ndarray) -> None:
    """Rows every selection must survive: all equal, one finite value among -inf, two values only."""
    logits[0] = 0.0
    logits[1] = -np.inf
    logits[1, -1] = 3.0
    logits[2] = np.where(np.arange(logits.shape[1]) % 3 == 0, 1.0, -1.0)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("vocab", [1000, 151936])
@pytest.mark.parametrize("count", [1, 50, MAX_CANDIDATES])
def test_candidates_equal_numpy(rows, vocab, count):
    rng = np.random.default_rng(rows * vocab + count)
    logits = random_tied_logits(rng, rows + 3, vocab)  # [B, V]
    special_rows(logits)
    picked = rng.permutation(rows + 3)[:rows]  # a subset of the rows, out of order
    temperature = rng.choice([0.3, 1.0, 2.5], rows).astype(np.float32)  # [R]
    count = min(count, vocab)
    everything = np.ones(rows, dtype=bool)
    expected = HostLogits(logits).candidates(picked, temperature, count, everything)
    device = cupy.asarray(logits)
    poison()
    ours = DeviceLogits(device, GPU).candidates(picked, temperature, count, everything)
    assert not np.isnan(ours.logits).any() and (ours.token_ids >= 0).all(), "an output was not written"
    np.testing.assert_array_equal(ours.token_ids, expected.token_ids)
    np.testing.assert_array_equal(ours.logits, expected.logits)
    np.testing.assert_array_equal(ours.lse, expected.lse)
    np.testing.assert_array_equal(ours.sums, expected.sums)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("vocab", [3000, 151936])
def test_sampling_on_the_device_gives_the_host_tokens(rows, vocab):
    rng = np.random.default_rng(rows + vocab)
    params = [random_params(rng) for _ in range(rows)]
    states, twins = ([SamplingState(p, np.random.default_rng(p.seed), np.array([1, 2, 3]), [0, 4]) for p in params]
                     for _ in range(2))
    for _ in range(3):
        logits = random_tied_logits(rng, rows, vocab)  # [B, V]
        poison()
        assert_same_output(Sampler().sample_from(DeviceLogits(cupy.asarray(logits), GPU), states),
                           Sampler().sample(logits, twins))


class CountedDeviceLogits(DeviceLogits):
    """DeviceLogits that records the rows copied whole and the rows drawn on the device."""

    def __init__(self, logits, backend):
        super().__init__(logits, backend)
        self.copied: list[int] = []
        self.drawn: list[int] = []

    def rows(self, rows):
        self.copied += rows.tolist()
        return super().rows(rows)

    def whole_vocabulary_draws(self, rows, temperature, uniform):
        self.drawn += rows.tolist()
        return super().whole_vocabulary_draws(rows, temperature, uniform)


def drawn_on_device(params: SamplingParams) -> bool:
    """A whole-vocabulary row asking for its token alone: the device draws it (top_candidates with draws)."""
    return params.min_p <= 0.0 and params.logprobs is None


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("vocab", [3000, 151936])
def test_whole_vocabulary_rows_on_the_device_give_the_host_tokens(rows, vocab):
    """Rows without top-k or top-p (the default, plain temperature, min-p, logprobs at temperature 1): the tokens
    of the host path and of a walk over the whole row, and a row copied only where that walk needs it."""
    assert MAX_CANDIDATES >= TOP_P_CANDIDATES  # else such rows would all be copied whole
    rng = np.random.default_rng(3 * rows + vocab)
    params = whole_vocabulary_params(rng, rows)
    states, twins = ([SamplingState.from_params(p, [1, 2]) for p in params] for _ in range(2))
    for _ in range(3):
        logits = whole_vocabulary_logits(rng, rows, vocab)  # [B, V]
        uniforms = [copy.deepcopy(s.generator).random() for s in states]
        expected = [reference_walk(logits[b], p.temperature, p.min_p, uniforms[b]) for b, p in enumerate(params)]
        poison()
        source = CountedDeviceLogits(cupy.asarray(logits), GPU)
        ours = Sampler().sample_from(source, states)
        assert_same_output(ours, Sampler().sample(logits, twins))
        assert ours.token_ids.tolist() == [token for token, _ in expected]
        assert sorted(source.drawn) == [b for b, p in enumerate(params) if drawn_on_device(p)]
        assert sorted(source.copied) == [b for b, (p, (_, beyond)) in enumerate(zip(params, expected))
                                         if (beyond and not drawn_on_device(p))
                                         or (p.logprobs is not None and p.temperature != 1.0)]


def test_a_flat_row_on_the_device_draws_beyond_the_candidates():
    """A flat row over V = 151936 at temperature 2: a draw lands among the 1024 candidates with probability
    1024 / V, so nearly every row walks beyond them: on the device (no row copied), to the host's tokens. With
    min-p the host walks every row, copied (the total under min-p needs the whole row)."""
    rows, vocab = 16, 151936
    logits = np.zeros((rows, vocab), dtype=np.float32)
    logits[:, ::2] = np.float32(1e-3)  # not all equal: the even ids come first
    for min_p in (0.0, 1e-9):
        params = [SamplingParams(temperature=2.0, seed=b, min_p=min_p) for b in range(rows)]
        poison()
        source = CountedDeviceLogits(cupy.asarray(logits), GPU)
        ours = Sampler().sample_from(source, [SamplingState.from_params(p, []) for p in params])
        assert_same_output(ours, Sampler().sample(logits, [SamplingState.from_params(p, []) for p in params]))
        beyond = [b for b in range(rows) if ours.token_ids[b] not in range(0, 2 * TOP_P_CANDIDATES, 2)]
        assert len(beyond) >= rows - 2
        assert sorted(source.copied) == ([] if min_p == 0.0 else list(range(rows)))  # min-p: the total needs the row
        assert sorted(source.drawn) == (list(range(rows)) if min_p == 0.0 else [])


class HostCheckedSampler(Sampler):
    """Samples from the device, and checks every step against the host sampler given the same logits."""

    steps = 0

    def sample_from(self, source, states):
        assert isinstance(source, DeviceLogits)
        logits = source.rows(np.arange(len(states)))  # [B, V]
        twins = copy.deepcopy(states)
        ours = super().sample_from(source, states)
        assert_same_output(ours, Sampler().sample(logits, twins))  # a plain host sampler, not this override
        HostCheckedSampler.steps += 1
        return ours


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0),
    SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3),
    SamplingParams(max_tokens=12, temperature=1.0, top_k=20, min_p=0.05, seed=4, logprobs=3),
    SamplingParams(max_tokens=12, temperature=0.7, presence_penalty=1.0, seed=5),
    SamplingParams(max_tokens=12, temperature=1.3, seed=6),
    SamplingParams(max_tokens=12, seed=7, logprobs=2),  # the OpenAI default: the whole vocabulary at temperature 1
    SamplingParams(max_tokens=12, temperature=0.9, min_p=0.02, seed=8),
])
def test_the_engine_samples_on_the_device_as_the_host_does(tiny_model_dir, params):
    # Greedy decode steps skip the sampler with async scheduling (the graph's argmaxes are the tokens): off here.
    llm = LLM(str(tiny_model_dir), device="cuda", async_scheduling=False)
    llm.engine.runner.sampler = HostCheckedSampler()
    HostCheckedSampler.steps = 0
    outputs = llm.generate(["Mixture of experts", "The quick brown fox", "你好"], params)
    assert all(len(o.token_ids) > 0 for o in outputs)
    assert HostCheckedSampler.steps > 1 and llm.engine.runner.graphs._graphs  # decode steps ran as graphs
