"""GPU expert slots (experts/gpu_tier.py) on a tiny exported model (CUDA GPU).

Logits are bit-identical to the fully resident GPU model at 1, 2 and 8 slots per MoE layer, with the L2 tier
holding every expert, some of them or none (experts.bin through the staging ring), with and without prefetch: a
block computes the same in any slot and pass. Experts computed on the CPU (`cpu_experts` all / auto), whole or cut
by rows with the GPU, accumulate in another order, so they match within 1e-5 of the largest logit, with the same
greedy tokens. Corrupt blocks are
reported naming layer and expert, at start when L2 reads every block, at the read otherwise. The server answers
as the resident one does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (GPU tests need cupy-cuda12x or cupy-cuda13x)")
if not cupy.cuda.is_available():
    pytest.skip("CuPy finds no CUDA GPU", allow_module_level=True)

from test_expert_tiers import answers, budget, corrupt_copy, moe16_dir, step_logits  # noqa: E402,F401
from test_parity import NEW_TOKENS, colibri_greedy, colibri_logits, prompt_ids, relative_error  # noqa: E402
from test_server import LiveServer, request  # noqa: E402
from tiny_models import ARCHITECTURES, build_hf_model  # noqa: E402

from colibri_stream.backends.cupy_moe import DeviceExpertStore  # noqa: E402
from colibri_stream.checkpoint import read_config  # noqa: E402
from colibri_stream.config import ExpertStoreConfig  # noqa: E402
from colibri_stream.errors import CheckpointError  # noqa: E402
from colibri_stream.experts.cpu_executor import CpuExpertExecutor  # noqa: E402
from colibri_stream.experts.gpu_tier import GpuTieredStore  # noqa: E402
from colibri_stream.experts.placement import Bandwidths  # noqa: E402
from colibri_stream.experts.slots import layer_slot_counts  # noqa: E402
from colibri_stream.experts.trace import read_trace  # noqa: E402
from colibri_stream.loader import load_model  # noqa: E402

pytestmark = pytest.mark.gpu


def gpu_budget(model_dir, slots: int) -> int:
    """--gpu-memory-limit for `slots` GPU slots per MoE layer: the dense weights, the slots, the staging block."""
    return (model_dir / read_config(model_dir).dense_file).stat().st_size + budget(model_dir, slots)


def host_budget(model_dir, host: str) -> int | None:
    return {"none": None, "some": budget(model_dir, 3), "all": budget(model_dir, 16)}[host]


def assert_resident_tokens(got: list[np.ndarray], want: list[np.ndarray], exact: bool = False) -> None:
    """Each step's logits equal the resident model's bit for bit (`exact`), or within 1e-5 of the largest logit
    with the same greedy tokens (experts computed on the CPU add up in another order)."""
    for ours, theirs in zip(got, want, strict=True):
        if exact:
            np.testing.assert_array_equal(ours, theirs)
        else:
            assert relative_error(ours, theirs) < 1e-5
            assert (ours.argmax(axis=-1) == theirs.argmax(axis=-1)).all()


@pytest.fixture(scope="module")
def resident_gpu_logits(moe16_dir):  # noqa: F811
    model = load_model(str(moe16_dir), device="cuda")
    assert isinstance(model.store, DeviceExpertStore)
    return step_logits(model)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("host", ["none", "some", "all"])
@pytest.mark.parametrize("gpu_slots", [1, 2, 8])
def test_gpu_slots_give_the_resident_logits_bit_for_bit(moe16_dir, resident_gpu_logits, gpu_slots, host,  # noqa: F811
                                                        prefetch):
    options = ExpertStoreConfig(gpu_memory_limit=gpu_budget(moe16_dir, gpu_slots),
                                l2_cache_size=host_budget(moe16_dir, host), prefetch=prefetch, cpu_experts="off")
    model = load_model(str(moe16_dir), device="cuda", experts=options)
    assert isinstance(model.store, GpuTieredStore)
    assert_resident_tokens(step_logits(model), resident_gpu_logits, exact=True)
    stats = model.store.stats()
    gpu = stats.tiers["gpu"]
    assert gpu.hits + gpu.misses == int(stats.used.sum())
    assert gpu.misses > 0 and stats.compute.cpu_experts == 0
    assert set(stats.tiers) == {"gpu", "host", "disk"} if host != "none" else {"gpu", "disk"}
    if host == "all":
        assert stats.tiers["disk"].bytes_read == 0  # every block came from pinned memory
    else:
        assert stats.tiers["disk"].bytes_read > 0
    if prefetch:
        assert stats.prefetch_loads > 0 and stats.prefetch_recall is not None


@pytest.mark.parametrize("cpu_experts", ["all", "auto"])
@pytest.mark.parametrize("host", ["none", "all"])
def test_experts_computed_on_the_cpu_match_within_float32_rounding(moe16_dir, resident_gpu_logits,  # noqa: F811
                                                                   cpu_experts, host):
    options = ExpertStoreConfig(gpu_memory_limit=gpu_budget(moe16_dir, 2), l2_cache_size=host_budget(moe16_dir, host),
                                cpu_experts=cpu_experts)
    model = load_model(str(moe16_dir), device="cuda", experts=options)
    got = step_logits(model)
    assert_resident_tokens(got, resident_gpu_logits)
    stats = model.store.stats()
    if cpu_experts == "all":
        assert stats.compute.cpu_experts == stats.tiers["gpu"].misses > 0
        assert stats.compute.cpu_bytes_read > 0
    assert stats.compute.cpu_experts + stats.compute.gpu_experts >= int(stats.used.sum())


@pytest.mark.parametrize("cpu_experts", ["off", "all"])
def test_whole_layers_on_the_gpu_give_the_resident_tokens(moe16_dir, resident_gpu_logits, cpu_experts):  # noqa: F811
    """--gpu-slot-layout layers: a budget of 6 slots a layer (3 MoE layers of 16 experts) becomes one whole layer (the
    last), 2 slots in the one before and none in the first. Loads alone give the resident logits bit for bit; the
    CPU computing every miss, within rounding."""
    options = ExpertStoreConfig(gpu_memory_limit=gpu_budget(moe16_dir, 6), l2_cache_size=host_budget(moe16_dir, "all"),
                                cpu_experts=cpu_experts, gpu_slot_layout="layers", cpu_threads=2)
    model = load_model(str(moe16_dir), device="cuda", experts=options)
    assert cpu_experts == "off" or model.store.executor.num_threads == min(2, CpuExpertExecutor().num_threads)
    counts = [slots.num_slots for slots in model.store._layers]
    config = read_config(moe16_dir)
    assert counts == layer_slot_counts(6, len(config.moe_layers), config.num_experts, "layers") == [0, 2, 16]
    got = step_logits(model)
    assert_resident_tokens(got, resident_gpu_logits, exact=cpu_experts == "off")
    stats = model.store.stats()
    whole = [rank for rank, n in enumerate(counts) if n == config.num_experts]
    assert whole and stats.tiers["gpu"].misses > 0
    assert all(stats.used[rank] > 0 for rank in whole)
    assert (stats.compute.cpu_experts > 0) == (cpu_experts == "all")


def count_synchronisations(store) -> list[int]:
    """Wrap the store's read-back wait (the real one still runs) to count the times the host waits for routing."""
    calls, wait = [0], store._readback.wait

    def counted(stream):
        calls[0] += 1
        wait(stream)

    store._readback.wait = counted
    return calls


@pytest.mark.parametrize(("cpu_experts", "host", "prefetch"), [("off", "all", False), ("off", "all", True),
                                                              ("auto", "all", False), ("auto", "none", True)])
def test_layers_holding_every_expert_skip_the_synchronisation(moe16_dir, resident_gpu_logits, cpu_experts,  # noqa: F811
                                                              host, prefetch):
    """33 slots as whole layers: [1, 16, 16]. The two whole layers never wait for their routing (one read-back a
    step, the first layer's), give the resident logits (bit for bit without CPU experts), and are counted as the
    synchronising store counts them, one step late (at their next step or the next read-back). The CPU's part runs
    on the CPU thread's Python, reading experts.bin without a host tier."""
    options = ExpertStoreConfig(gpu_memory_limit=gpu_budget(moe16_dir, 11), l2_cache_size=host_budget(moe16_dir, host),
                                cpu_experts=cpu_experts, gpu_slot_layout="layers", cpu_threads=2, prefetch=prefetch)
    model = load_model(str(moe16_dir), device="cuda", experts=options)
    assert [slots.num_slots for slots in model.store._layers] == [1, 16, 16]
    assert model.store._sync_free == [False, True, True]
    # no CPU dispatch without CPU experts; with them, the tiny experts are under the compiled worker's size: the CPU
    # thread's Python computes them
    assert model.store.cpu is None if cpu_experts == "off" else model.store.cpu.worker is None
    waits = count_synchronisations(model.store)
    got = step_logits(model)
    assert waits[0] == len(got)  # one read-back a step: the first layer's
    assert_resident_tokens(got, resident_gpu_logits, exact=cpu_experts == "off")
    for rank in list(model.store._untallied):  # the last step's routing of the whole layers
        model.store._tally_resident(rank)
    stats = model.store.stats()
    spread = load_model(str(moe16_dir), device="cuda", experts=ExpertStoreConfig(
        gpu_memory_limit=gpu_budget(moe16_dir, 2), l2_cache_size=host_budget(moe16_dir, "all"), cpu_experts="off"))
    spread_waits = count_synchronisations(spread.store)
    step_logits(spread)
    assert spread_waits[0] == 3 * len(got)
    np.testing.assert_array_equal(stats.used, spread.store.stats().used)  # the same routing, counted alike
    gpu = stats.tiers["gpu"]
    assert gpu.hits + gpu.misses == int(stats.used.sum())
    assert gpu.misses <= int(stats.used[0])  # only the first layer misses
    assert stats.steps == len(got)


def worker_store(model_dir, slots, cpu_experts: str = "auto", **options):
    """A GpuTieredStore over the model's experts with every block in pinned memory and the CpuLayerWorker (its
    kernel taking experts of any size), and the model that runs it."""
    from colibri_stream.backends.cupy_backend import CupyBackend
    from colibri_stream.checkpoint import ModelFolder
    from colibri_stream.experts.pinned import PinnedExperts
    from colibri_stream.experts.policies import make_policy
    from colibri_stream.experts.tiers import BlockReader
    from colibri_stream.model.transformer import MoETransformer

    folder = ModelFolder(model_dir)
    config, experts = folder.config, folder.experts
    reader = BlockReader(experts)
    policies = [make_policy("lfu", config.num_experts) for _ in config.moe_layers]
    store = GpuTieredStore(experts, slots, policies, PinnedExperts(experts, reader), reader, None,
                           CpuExpertExecutor(min_kernel_bytes=0), cpu_experts, **options)
    return store, MoETransformer(config, folder.dense, store, CupyBackend())


def test_whole_layers_beside_the_cpu_worker_give_the_resident_tokens(moe16_dir, resident_gpu_logits):  # noqa: F811
    """Whole layers [1, 16, 16] that skip the read-back while the CpuLayerWorker (its kernel taking experts of any
    size) computes the first layer's misses: one read-back a step, the resident tokens, logits within rounding."""
    store, model = worker_store(moe16_dir, [1, 16, 16], cpu_experts="all")
    assert store.cpu.worker is not None and store._sync_free == [False, True, True]
    waits = count_synchronisations(store)
    got = step_logits(model)
    assert waits[0] == len(got)
    assert_resident_tokens(got, resident_gpu_logits)
    stats = store.stats()
    assert stats.compute.cpu_experts == stats.tiers["gpu"].misses > 0


EVEN = Bandwidths(host_read=1e9, h2d=1e9, disk=1e9, cpu_flops=1e15, measured=True)  # a lone miss is cut in two


@pytest.mark.parametrize("host", ["none", "some", "all"])
def test_experts_cut_between_cpu_and_gpu_match_within_float32_rounding(moe16_dir, resident_gpu_logits,  # noqa: F811
                                                                       host):
    """With the CPU as fast as the copy, a layer's lone miss is cut: the GPU computes its first rows from a packed
    partial copy, the CPU the rest. Without a host tier (experts.bin through the staging ring) nothing is cut."""
    options = ExpertStoreConfig(gpu_memory_limit=gpu_budget(moe16_dir, 2), l2_cache_size=host_budget(moe16_dir, host),
                                cpu_experts="auto")
    model = load_model(str(moe16_dir), device="cuda", experts=options)
    model.store.bandwidths, model.store.adapt_rates = EVEN, False
    got = step_logits(model)
    assert_resident_tokens(got, resident_gpu_logits)
    compute = model.store.stats().compute
    assert (compute.split_experts > 0) == (host != "none")


@pytest.mark.parametrize("export", [dict(quantize="int4"), dict(quantize="int4", group_size=32, zero_point=True),
                                    dict(quantize="fp8"), dict(quantize="fp8", fp8_scales="channel")])
def test_quantized_experts_cut_between_cpu_and_gpu_give_the_resident_tokens(export, tmp_path):
    """int4 and fp8 experts of 256 intermediate rows cut at whole groups (int4's, fp8's tiles): the GPU part's
    kernels read the packed first groups and down's whole scales, the CPU's kernel the rest; the resident model's
    greedy tokens, logits within 1e-4 of the largest (the GPU kernels' activations in 16-bit or int8 parts against
    the CPU's float32, as tests/test_gpu_quant_experts.py allows)."""
    from colibri_stream.export import export_model

    build_hf_model("qwen3_moe", tmp_path / "hf", moe_intermediate_size=256)
    export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False, **export)
    model_dir = tmp_path / "model"
    resident = load_model(str(model_dir), device="cuda")
    tiered = load_model(str(model_dir), device="cuda",
                        experts=ExpertStoreConfig(gpu_memory_limit=gpu_budget(model_dir, 1),
                                                  l2_cache_size=budget(model_dir, 8), cpu_experts="auto"))
    tiered.store.bandwidths, tiered.store.adapt_rates = EVEN, False
    ids = prompt_ids()
    assert relative_error(colibri_logits(tiered, ids), colibri_logits(resident, ids)) < 1e-4
    assert colibri_greedy(tiered, ids, NEW_TOKENS) == colibri_greedy(resident, ids, NEW_TOKENS)
    assert tiered.store.stats().compute.split_experts > 0


@pytest.mark.parametrize("cpu_experts", ["all", "auto"])
def test_the_cpu_worker_gives_the_resident_tokens(moe16_dir, resident_gpu_logits, cpu_experts):  # noqa: F811
    """The int8 experts of the tiny model go through the CpuLayerWorker (one compiled call per layer, the flag
    raised by it) once the executor's kernel takes experts of any size: the same tokens, logits within rounding,
    every expert counted; "auto" with the CPU as fast as the copy cuts experts between the worker and the GPU."""
    store, model = worker_store(moe16_dir, 2, cpu_experts, bandwidths=EVEN if cpu_experts == "auto" else None)
    assert store.cpu.worker is not None and store.cpu.flag is not None
    assert_resident_tokens(step_logits(model), resident_gpu_logits)
    stats = store.stats()
    assert stats.compute.cpu_experts > 0 and stats.compute.cpu_bytes_read > 0 and stats.compute.cpu_seconds > 0
    if cpu_experts == "all":
        assert stats.compute.cpu_experts == stats.tiers["gpu"].misses
    else:
        assert stats.compute.split_experts > 0


def test_a_corrupt_block_is_reported_when_read_and_at_start_when_l2_reads_all(moe16_dir, tmp_path):  # noqa: F811
    config = read_config(moe16_dir)
    layer = config.moe_layers[-1]
    folder = moe16_dir
    for expert in range(2, 16):  # every block of the last layer but the two the warm start loads
        folder = corrupt_copy(folder, tmp_path / str(expert), layer, expert)
    failure = rf"expert \d+ of layer {layer} fails its checksum"
    model = load_model(str(folder), device="cuda",
                       experts=ExpertStoreConfig(gpu_memory_limit=gpu_budget(moe16_dir, 2), cpu_experts="off"))
    with pytest.raises(CheckpointError, match=failure):
        step_logits(model)
    assert model.store.stats().load_errors >= 1
    with pytest.raises(CheckpointError, match=failure):
        load_model(str(folder), device="cuda",
                   experts=ExpertStoreConfig(gpu_memory_limit=gpu_budget(moe16_dir, 2),
                                             l2_cache_size=host_budget(moe16_dir, "all")))


def test_a_corrupt_block_the_cpu_reads_fails_the_step_and_the_gpu_does_not_hang(moe16_dir, tmp_path):  # noqa: F811
    """The first MoE layer's misses are computed on the CPU from experts.bin, where they fail their checksums: the
    CPU thread still raises the flag the stream waits on, and the step raises the error at the next layer."""
    config = read_config(moe16_dir)
    layer = config.moe_layers[0]
    folder = moe16_dir
    for expert in range(2, 16):  # every block of the first MoE layer but the two the warm start loads
        folder = corrupt_copy(folder, tmp_path / str(expert), layer, expert)
    model = load_model(str(folder), device="cuda",
                       experts=ExpertStoreConfig(gpu_memory_limit=gpu_budget(moe16_dir, 2), cpu_experts="all"))
    for _ in range(2):  # and again: nothing is left waiting
        with pytest.raises(CheckpointError, match=rf"expert \d+ of layer {layer} fails its checksum"):
            step_logits(model)


FRESH_PROCESS = """
import sys
sys.path.insert(0, sys.argv[1])
from test_parity import colibri_greedy, prompt_ids
from colibri_stream.config import ExpertStoreConfig
from colibri_stream.loader import load_model
model = load_model(sys.argv[2], device="cuda",
                   experts=ExpertStoreConfig(gpu_memory_limit=int(sys.argv[3]), cpu_experts="all"))
print(colibri_greedy(model, prompt_ids(), 8))
"""


def test_kernels_loaded_while_the_stream_waits_for_the_cpu_do_not_hang_a_fresh_process(tmp_path):
    """In a new process every kernel after a layer's CPU hand-off (the add of the CPU's sum, Qwen2-MoE's shared
    expert, the next layers) is loaded for the first time while the stream waits on the CPU thread's flag; CUDA may
    synchronise the context to load a kernel, and the load releases the GIL, so the CPU thread still ends the
    wait. The step finishes (in time) with the resident model's tokens."""
    from colibri_stream.export import export_model

    build_hf_model("qwen2_moe", tmp_path / "hf")
    export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False)
    model_dir = tmp_path / "model"
    want = colibri_greedy(load_model(str(model_dir), device="cuda"), prompt_ids(), 8)
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(Path(__file__).parent), str(model_dir),
                           str(gpu_budget(model_dir, 1))], capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str(want)


def test_server_on_gpu_slots_answers_like_the_resident_gpu_server(tiny_model_dir):
    """Bit for bit: both launch every step eagerly (GPU slots never use decode graphs, and a graph's padded batch
    may split decode attention differently, which changes float32 rounding)."""
    prompts = ["Mixture of experts", "The quick brown fox", "你好"]
    tiered = {"gpu_memory_limit": gpu_budget(tiny_model_dir, 1), "cpu_experts": "off"}
    results = {}
    for name, options in {"resident": {"cuda_graphs": False}, "tiered": tiered}.items():
        live = LiveServer(tiny_model_dir,
                          {"max_batch_size": 4, "device": "cuda", "matmul_precision": "high", **options})
        try:
            results[name] = answers(live, prompts)
            _, _, metrics = request(live, "GET", "/metrics", key=None)
        finally:
            live.close()
        assert (b'colibri_expert_tier_hits_total{tier="gpu"}' in metrics) == (name == "tiered")
        assert (b'colibri_expert_computed_total{device="gpu"}' in metrics) == (name == "tiered")
    assert results["tiered"] == results["resident"]


@pytest.mark.parametrize("budget", ["resident", "slots"])
def test_routing_trace_on_the_gpu(moe16_dir, resident_gpu_logits, tmp_path, budget):  # noqa: F811
    """Recording on the GPU (resident experts or slots) changes no logit and writes the CPU's trace."""
    config = read_config(moe16_dir)
    cpu = load_model(str(moe16_dir), device="cpu",
                     experts=ExpertStoreConfig(routing_trace=str(tmp_path / "cpu.jsonl")))
    step_logits(cpu)
    cpu.store.flush()
    options = {"routing_trace": str(tmp_path / "gpu.jsonl")}
    if budget == "slots":
        options.update(gpu_memory_limit=gpu_budget(moe16_dir, 2), cpu_experts="off")
    gpu = load_model(str(moe16_dir), device="cuda", experts=ExpertStoreConfig(**options))
    assert_resident_tokens(step_logits(gpu), resident_gpu_logits, exact=True)
    gpu.store.flush()
    assert read_trace(tmp_path / "gpu.jsonl", config) == read_trace(tmp_path / "cpu.jsonl", config)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("cpu_experts", ["all", "off", "cut"])
def test_one_gpu_slot_per_layer_on_every_architecture(arch, cpu_experts, tmp_path):
    """Hybrid (every miss on the CPU), all-GPU (every miss copied) and cut (the cost model with the CPU as fast as
    the copy, so misses are cut by rows between them) against the resident GPU model: the same 32 greedy tokens,
    logits within 1e-5 of the largest (fp32 export: float32 accumulation on both sides)."""
    from colibri_stream.export import export_model

    build_hf_model(arch, tmp_path / "hf")
    export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False)
    model_dir = tmp_path / "model"
    resident = load_model(str(model_dir), device="cuda")
    tiered = load_model(str(model_dir), device="cuda",
                        experts=ExpertStoreConfig(gpu_memory_limit=gpu_budget(model_dir, 1),
                                                  l2_cache_size=budget(model_dir, 8) if cpu_experts == "cut" else None,
                                                  cpu_experts="auto" if cpu_experts == "cut" else cpu_experts))
    assert isinstance(tiered.store, GpuTieredStore)
    if cpu_experts == "cut":
        tiered.store.bandwidths, tiered.store.adapt_rates = EVEN, False
    ids = prompt_ids()
    assert relative_error(colibri_logits(tiered, ids), colibri_logits(resident, ids)) < 1e-5, arch
    assert colibri_greedy(tiered, ids, NEW_TOKENS) == colibri_greedy(resident, ids, NEW_TOKENS), arch
    compute = tiered.store.stats().compute
    assert (compute.cpu_experts > 0) == (cpu_experts != "off")
    assert (compute.split_experts > 0) == (cpu_experts == "cut")


@pytest.mark.parametrize("quantize", [None, "mxfp4"])
@pytest.mark.parametrize("cpu_experts", ["all", "off", "worker"])
def test_gpt_oss_experts_in_gpu_slots_give_the_resident_tokens(quantize, cpu_experts, tmp_path):
    """gpt-oss's biased clamped-SwiGLU experts in one GPU slot per layer: the slots' blocks hold the biases the MoE
    kernels add; misses copied ("off"), computed by the CPU thread's executor ("all") or by the CpuLayerWorker
    ("worker", its kernel taking experts of any size) with their biases and activation: the resident model's greedy
    tokens, logits within 1e-5 of the largest (mxfp4: 1e-4, the GPU kernel's activations in two int8 parts per
    chunk against the CPU's float32, as tests/test_gpu_quant_experts.py allows). Nothing is cut (a part would need
    the down bias once)."""
    from colibri_stream.export import export_model

    build_hf_model("gpt_oss", tmp_path / "hf", seed=5)
    export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", quantize=quantize, progress=False)
    model_dir = tmp_path / "model"
    resident = load_model(str(model_dir), device="cuda")
    if cpu_experts == "worker":
        store, tiered = worker_store(model_dir, 1, "all")
        assert store.cpu.worker is not None
    else:
        tiered = load_model(str(model_dir), device="cuda",
                            experts=ExpertStoreConfig(gpu_memory_limit=gpu_budget(model_dir, 1),
                                                      l2_cache_size=budget(model_dir, 8), cpu_experts=cpu_experts))
        store = tiered.store
    assert isinstance(store, GpuTieredStore) and not store._cuttable
    ids = prompt_ids()
    assert relative_error(colibri_logits(tiered, ids), colibri_logits(resident, ids)) < (1e-4 if quantize else 1e-5)
    assert colibri_greedy(tiered, ids, NEW_TOKENS) == colibri_greedy(resident, ids, NEW_TOKENS)
    compute = store.stats().compute
    assert (compute.cpu_experts > 0) == (cpu_experts != "off") and compute.split_experts == 0
