"""benchmarks/offload.py on the CPU, where it needs no GPU: the model of its command line (a shape's own split or
--dense-layers), llama.cpp's --n-cpu-moe for each GPU expert budget, and --write-only's folder and GGUF file of a
tiny DeepSeek-V3 (its GGUF checked where COLIBRI_GGUF_PY names llama.cpp's gguf-py)."""

from __future__ import annotations

import os
import types

import pytest
from conftest import imported_benchmarks

from colibri_stream import synthetic
from colibri_stream.checkpoint import read_config
from colibri_stream.experts.slots import layer_slot_counts

GGUF_PY = os.environ.get("COLIBRI_GGUF_PY")


@pytest.fixture(scope="module")
def offload():
    with imported_benchmarks("offload") as (module,):
        yield module


@pytest.fixture(scope="module")
def offload_llama():
    with imported_benchmarks("offload_llama") as (module,):
        yield module


@pytest.fixture
def tiny_deepseek(monkeypatch):
    """A "tiny-deepseek-v3" shape: DeepSeek-V3's options (3 leading dense layers, shared expert, latent attention)
    at llama_cpp_parity.py's tiny widths."""
    with imported_benchmarks("llama_cpp_parity") as (parity,):
        sizes = {k: v for k, v in parity.TINY["deepseek_v3"][2].items() if k != "moe_layers"}
    monkeypatch.setitem(synthetic.SHAPES, "tiny-deepseek-v3", dict(synthetic.SHAPES["deepseek-v3"], **sizes))
    return "tiny-deepseek-v3"


def test_n_cpu_moe_counts_the_dense_blocks_and_whole_layers(offload, offload_llama):
    """--n-cpu-moe N moves blocks 0..N-1's experts: behind a dense first block 50 % of two MoE layers is N = 2 (the
    first MoE layer, as Colibri's layers layout leaves it to the host), 0 % N = 3; half of one MoE layer, or a
    quarter of two, is no N."""
    deepseek = offload.benchmark_config("deepseek-v3", 3, 1)
    assert [offload_llama.llama_cpu_moe(deepseek, f) for f in (0.0, 0.25, 0.5, 1.0)] == [3, None, 2, 0]
    assert layer_slot_counts(round(0.5 * 256), 2, 256, "layers") == [0, 256]  # layer 1 on the host, 2 on the GPU
    one_moe = offload.benchmark_config("deepseek-v3", 2, 1)
    assert [offload_llama.llama_cpu_moe(one_moe, f) for f in (0.0, 0.5, 1.0)] == [2, None, 0]
    mixtral = offload.benchmark_config("mixtral-8x7b", 8)
    assert [offload_llama.llama_cpu_moe(mixtral, f) for f in (0.0, 0.25, 0.5, 0.3)] == [8, 6, 4, None]


def test_llama_cpp_runs_at_whole_layer_budgets_only(offload, offload_llama, monkeypatch, tmp_path):
    """llama-bench runs at the budgets it can place (the --n-cpu-moe of llama_cpu_moe) and fills those records;
    the others' records say why it did not run."""
    import llama_cpp

    calls = []

    def bench(binary, gguf, n_cpu_moe, threads, **options):
        calls.append(n_cpu_moe)
        return {"n_cpu_moe": n_cpu_moe, "decode_tok_s": 10.0 + n_cpu_moe, "prefill_tok_s": 100.0 + n_cpu_moe}

    monkeypatch.setattr(llama_cpp, "llama_bench", bench)
    config = offload.benchmark_config("deepseek-v3", 3, 1)
    args = types.SimpleNamespace(fractions=[0.0, 0.25, 0.5], llama_bench="llama-bench", gguf="m.gguf",
                                 llama_threads=16, prefill=512, out=str(tmp_path / "offload.json"))
    records = [dict(gpu_expert_fraction=f, source="l2", batch=b) for f in args.fractions for b in (1, "prefill")]
    saved = []
    offload_llama.llama_cpp_baseline(args, config, records, 32, lambda: saved.append(len(records)))
    assert saved == [len(records)] * 3  # after each budget
    assert calls == [3, 2]
    by_case = {(r["gpu_expert_fraction"], r["batch"]): r for r in records}
    assert by_case[0.5, 1]["llama_cpp_tok_s"] == 12.0 and by_case[0.5, "prefill"]["llama_cpp_tok_s"] == 102.0
    assert by_case[0.5, 1]["llama_cpp"]["host_moe_layers"] == [1]
    assert by_case[0.0, 1]["llama_cpp"]["host_moe_layers"] == [1, 2]
    assert "llama_cpp_tok_s" not in by_case[0.25, 1] and "whole number" in by_case[0.25, 1]["llama_cpp"]["skipped"]


def test_command_lines_without_a_model_to_offload_are_refused(offload, capsys):
    """DeepSeek-V3's own split leaves 3 layers no MoE layer; accelerate's baseline cannot build --dense-layers."""
    for shape, layers, dense, message in (("deepseek-v3", 3, [], "has no MoE layer"),
                                          ("deepseek-v3", 3, ["--dense-layers", "1"], "--accelerate-fractions"),
                                          ("mixtral-8x7b", 2, ["--dense-layers", "1"], "no dense MLP width")):
        with pytest.raises(SystemExit):
            offload.main(["--shape", shape, "--layers", str(layers), *dense])
        assert message in capsys.readouterr().err


def test_write_only_writes_the_folder_and_gguf_of_a_dense_first_layer(offload, tiny_deepseek, tmp_path):
    """--write-only writes the folder of --dense-layers' split (and, with --gguf-py, llama.cpp's deepseek2 file
    with one leading dense block) and times nothing; the folder is not taken for a model of another split."""
    folder, gguf = tmp_path / "model", tmp_path / "shm" / "model.gguf"
    argv = ["--shape", tiny_deepseek, "--layers", "3", "--dense-layers", "1", "--folder", str(folder), "--gguf",
            str(gguf), "--accelerate-fractions", "--write-only", "--out", str(tmp_path / "offload.json")]
    assert offload.main(argv + (["--gguf-py", GGUF_PY] if GGUF_PY else [])) == 0
    config = read_config(folder)
    assert config.moe_layers == (1, 2) and config.attention == "mla" and config.shared_expert_intermediate_size
    assert config == offload.benchmark_config(tiny_deepseek, 3, 1)
    assert not (tmp_path / "offload.json").exists()
    if GGUF_PY:
        import gguf as gguf_py

        reader = gguf_py.GGUFReader(str(gguf))
        assert reader.fields["deepseek2.leading_dense_block_count"].contents() == 1
        names = {t.name for t in reader.tensors}
        assert {"blk.0.ffn_gate.weight", "blk.1.ffn_gate_exps.weight", "blk.2.ffn_up_shexp.weight"} <= names
    with pytest.raises(SystemExit, match="holds another model"):
        offload.main(["--shape", tiny_deepseek, "--layers", "3", "--dense-layers", "2", *argv[6:]])
    assert read_config(folder) == config  # left as it was
