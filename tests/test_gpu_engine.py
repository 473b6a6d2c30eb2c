"""The engine's decode steps as CUDA graphs (backends/cuda_graph.DecodeGraphs) against eager steps (CUDA GPU).

Both run the same kernels (a captured step computes every projection with linear_rows, as the eager step does up
to SMALL_BATCH tokens), so at up to four sequences greedy and seeded sampled tokens are identical; a batch of five
is padded into the bucket of eight and compared by logits.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (GPU tests need cupy-cuda12x or cupy-cuda13x)")
if not cupy.cuda.is_available():
    pytest.skip("CuPy finds no CUDA GPU", allow_module_level=True)

from colibri_stream.backends.cuda_graph import DecodeGraphs, is_decode  # noqa: E402
from colibri_stream.llm import LLM  # noqa: E402
from colibri_stream.model import load_model  # noqa: E402
from colibri_stream.model.batch import flat_batch  # noqa: E402
from colibri_stream.request import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu
PROMPTS = ["Mixture of experts", "The quick brown fox", "你好"]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=16, temperature=0),
                                    SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3)])
def test_engine_decode_graphs_give_the_eager_tokens(tiny_model_dir, params):
    graphs = LLM(str(tiny_model_dir), device="cuda")
    assert graphs.engine.runner.graphs is not None
    eager = LLM(str(tiny_model_dir), device="cuda")
    eager.engine.runner.graphs = None
    assert ([r.token_ids for r in graphs.generate(PROMPTS, params)]
            == [r.token_ids for r in eager.generate(PROMPTS, params)])
    assert graphs.engine.runner.graphs._graphs  # decode steps ran as graphs


def test_a_padded_decode_batch_gives_the_eager_logits(tiny_model_dir):
    model = load_model(str(tiny_model_dir), device="cuda")
    block, per_seq, b = 4, 4, 5
    kv = model.allocate_kv_cache(b * per_seq, block)
    tables = np.arange(b * per_seq).reshape(b, per_seq).tolist()
    prompts = np.random.default_rng(0).integers(3, model.config.vocab_size, (b, 6)).tolist()
    first = model.forward(flat_batch(prompts, [0] * b, tables, [True] * b, block), kv)  # [b, V] prefill
    step = flat_batch([[int(t)] for t in first.argmax(axis=1)], [6] * b, tables, [True] * b, block)
    assert is_decode(step)
    graphs = DecodeGraphs(model, kv, per_seq, max_batch_size=32)
    assert graphs.fits(step)
    from_graph = graphs.logits(step)  # [5, V] from the bucket of 8
    eager = model.forward(step, kv)  # rewrites the same KV slots with the same values
    assert from_graph.shape == eager.shape
    assert np.abs(from_graph - eager).max() <= 1e-4 * np.abs(eager).max()
    assert not graphs.fits(flat_batch(prompts, [0] * b, tables, [True] * b, block))  # a prefill is not decode


def test_prefix_caching_on_the_gpu_gives_the_uncached_tokens():
    """The CPU test's workload (test_prefix_cache_engine.py: shared system prompts, repeats, second turns, under
    preemption) on the GPU. A cached prefix's blocks are read by a prefill chunk that starts after them, the
    kernels of chunked prefill. Greedy tokens equal with and without the cache; a difference is either a bug or a
    near-tie decided by float32 rounding (prefills of different lengths reduce in a different order): compare the
    logits to tell."""
    from test_prefix_cache_engine import TIGHT, workload

    from colibri_stream.engine import EngineCore

    options = {**TIGHT, "device": "cuda"}
    cached = EngineCore.from_pretrained(None, enable_prefix_caching=True, **options)
    plain = EngineCore.from_pretrained(None, enable_prefix_caching=False, **options)
    assert workload(cached) == workload(plain)
    assert cached.stats().prefix_cache_hit_tokens > 0 and cached.stats().num_preemptions > 0
