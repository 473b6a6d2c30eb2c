"""The sigmoid-routed families (GLM-4.5, MiniMax-M2, DeepSeek-V3) end to end: `colibri export`, `inspect` and
`generate` on the NumPy backend against transformers' greedy tokens; DeepSeek-V3's latent cache under prefix
caching and chunked prefill, and its FP8 checkpoint; the multi-token-prediction layers the published checkpoints
carry are skipped; the GPU backend refuses what it does not run in one line; the families Colibri does not run
are refused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.numpy import load_file, save_file  # noqa: E402

from colibri_stream.backends.cupy_backend import CupyBackend  # noqa: E402
from colibri_stream.backends.numpy_backend import NumpyBackend  # noqa: E402
from colibri_stream.checkpoint import ModelFolder  # noqa: E402
from colibri_stream.errors import CheckpointError, UnsupportedModelError  # noqa: E402
from colibri_stream.export import export_model  # noqa: E402
from colibri_stream.export.architectures import translate_config  # noqa: E402
from colibri_stream.loader import check_features  # noqa: E402
from conftest import TOKENIZER_VOCAB_SIZE, write_tokenizer  # noqa: E402
from test_parity import reference_greedy  # noqa: E402
from tiny_models import ARCHITECTURES, SIGMOID_ROUTED, build_hf_model, hf_config  # noqa: E402


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibri_stream", *args], capture_output=True, text=True, timeout=300)


# GLM-4.7-Flash computes as DeepSeek-V3 does (tests/test_parity.py): its CLI run would repeat deepseek_v3's
@pytest.mark.parametrize("arch", [arch for arch in SIGMOID_ROUTED if arch != "glm4_moe_lite"])
def test_cli_export_inspect_generate_match_transformers(arch, tmp_path):
    hf_model = build_hf_model(arch, tmp_path / "hf", vocab_size=TOKENIZER_VOCAB_SIZE)
    write_tokenizer(tmp_path / "hf")
    done = run_cli("export", str(tmp_path / "hf"), str(tmp_path / "model"), "--dtype", "fp32", "--quiet")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {tmp_path / 'model'}: {arch}, 3 layers, 8 experts (top-2)")

    shown = run_cli("inspect", str(tmp_path / "model"))
    assert shown.returncode == 0, shown.stderr
    assert "top-2 by sigmoid plus a correction bias (for the choice only)" in shown.stdout
    if arch == "glm4_moe":
        assert "from the best 1 of 2 groups" in shown.stdout and "scaled by 2.5" in shown.stdout
        assert "the first 8 of 16 dimensions of each head rotated" in shown.stdout
        assert "qk-norm per_head" in shown.stdout and "MoE: 1, 2" in shown.stdout
    elif arch == "minimax_m2":
        assert "the first 12 of 24 dimensions of each head rotated" in shown.stdout
        assert "qk-norm full" in shown.stdout and "groups" not in shown.stdout
    else:
        assert "Multi-head Latent Attention: 4 heads, query/key 12 + 8 rope dims, value 20" in shown.stdout
        assert "q LoRA rank 24; cached per token: latent 16 + rope key 8" in shown.stdout
        assert "interleaved pairs" in shown.stdout and "softmax scale 0.223607" in shown.stdout
        assert "RMSNorm eps 1e-06 (latents 1e-06)" in shown.stdout

    done = run_cli("generate", "--model", str(tmp_path / "model"), "--device", "cpu", "--prompt", "Hello world",
                   "--max-tokens", "10", "--ignore-eos", "--json")
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    prompt = np.array(printed["prompt_token_ids"])
    assert printed["token_ids"] == reference_greedy(hf_model, prompt, 10)


def test_latent_cache_serves_prefix_caching_and_chunked_prefill(tmp_path):
    """DeepSeek-V3's cache of latent rows under the engine: prompts computed in chunks of 8 tokens, a second prompt
    taking the first's shared blocks from the prefix cache, both decoding transformers' greedy tokens."""
    from colibri_stream.llm import LLM
    from colibri_stream.request import SamplingParams

    hf_model = build_hf_model("deepseek_v3", tmp_path / "hf", seed=2, vocab_size=TOKENIZER_VOCAB_SIZE)
    write_tokenizer(tmp_path / "hf")
    export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False)
    shared = [int(i) for i in np.random.default_rng(4).integers(3, TOKENIZER_VOCAB_SIZE, 21)]
    prompts = [shared + [5, 6, 7], shared + [9, 10]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(str(tmp_path / "model"), device="cpu", block_size=4, max_num_batched_tokens=8, max_batch_size=2,
             kv_cache_dtype="fp32") as llm:
        first = llm.generate(prompts[0], params)
        second = llm.generate(prompts[1], params)
        assert llm.engine.stats().prefix_cache_hit_tokens == 20  # the 5 full blocks of the shared 21 tokens
    for prompt, result in zip(prompts, (first, second)):
        assert result.token_ids == reference_greedy(hf_model, np.array(prompt), 6)


def test_latent_cache_bytes_per_token():
    """DeepSeek-V3's shape (transformers' DeepseekV3Config defaults): 61 layers of one 512 + 64 row, 576 values a
    layer instead of 128 heads x (192 key + 128 value) dims."""
    import transformers

    from colibri_stream.model.paged_kv import kv_bytes_per_token, kv_row_shape

    raw = transformers.DeepseekV3Config(rope_parameters={"rope_type": "default", "rope_theta": 1e4}).to_dict()
    config = translate_config(raw, {}, set(), "bfloat16", "bfloat16")
    assert kv_row_shape(config) == (1, 576)
    assert kv_bytes_per_token(config, "bfloat16") == 61 * 576 * 2
    assert kv_bytes_per_token(config, "float8_e4m3") == 61 * 576
    assert kv_row_shape(translated("glm4_moe")) == (2, 16)  # grouped-query: K heads of D, keys and values


def test_fp8_deepseek_v3_checkpoint_generates_like_its_dequantized_reference(tmp_path):
    """DeepSeek-V3 as it ships: FP8 block-scaled projections (the latent ones too, in partial 128 x 128 tiles at
    hidden size 160) and experts; the experts keep their FP8 bytes, the rest is dequantized."""
    import transformers

    from colibri_stream.loader import load_model
    from quantized_checkpoints import build_fp8_checkpoint
    from test_parity import colibri_greedy, colibri_logits, prompt_ids, reference_logits, relative_error

    state = build_fp8_checkpoint(tmp_path / "hf", "deepseek_v3", hidden_size=160)
    config = export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False)
    assert (config.attention, config.expert_dtype, config.expert_scales) == ("mla", "fp8", "block")
    reference = transformers.AutoModelForCausalLM.from_config(hf_config("deepseek_v3", hidden_size=160),
                                                              dtype=torch.float32)
    reference.load_state_dict(state)
    reference.eval()
    model = load_model(tmp_path / "model", verify=True)
    ids = prompt_ids()
    assert relative_error(colibri_logits(model, ids), reference_logits(reference, ids)) < 1e-4
    assert colibri_greedy(model, ids, 16) == reference_greedy(reference, ids, 16)


def with_mtp_layer(folder, layers: int) -> int:
    """Adds the tensors of a multi-token-prediction module after the decoder's `layers` layers to the checkpoint,
    as GLM-4.5's published checkpoints hold them; returns how many."""
    tensors = load_file(folder / "model.safetensors")
    h = tensors["model.embed_tokens.weight"].shape[1]
    extra = {f"model.layers.{layers}.eh_proj.weight": np.zeros((h, 2 * h), np.float32),
             f"model.layers.{layers}.enorm.weight": np.ones(h, np.float32),
             f"model.layers.{layers}.input_layernorm.weight": np.ones(h, np.float32)}
    save_file({**tensors, **extra}, folder / "model.safetensors", metadata={"format": "pt"})
    return len(extra)


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
def test_multi_token_prediction_layers_are_skipped_with_a_log_line(arch, tmp_path, caplog):
    build_hf_model(arch, tmp_path / "hf", num_nextn_predict_layers=1)
    count = with_mtp_layer(tmp_path / "hf", 3)
    with caplog.at_level(logging.WARNING):
        config = export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False)
    assert config.num_layers == 3
    assert f"skipping {count} tensors of the multi-token-prediction layers 3-3" in caplog.text
    assert not any(".layers.3." in name for name in ModelFolder(tmp_path / "model").dense.names)

    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(raw, num_nextn_predict_layers=0)))
    with pytest.raises(CheckpointError, match=r"3 tensors that config.json does not account for \(first: model\.lay"):
        export_model(tmp_path / "hf", tmp_path / "again", dtype="fp32", progress=False)


def translated(arch: str, **changes):
    raw = dict(hf_config(arch).to_dict(), **changes)
    return translate_config(raw, {}, {"model.layers.1.mlp.gate.e_score_correction_bias",
                                      "model.layers.0.mlp.e_score_correction_bias"}, "bfloat16", "bfloat16")


def test_deepseek_v2_routes_by_softmax_without_renormalising_and_refuses_what_transformers_would_not_compute():
    """DeepSeek-V2 (-Lite): softmax scores, the top-k taken as they are, scaled; the full model's
    group_limited_greedy chooses from the groups whose best score is highest (run on the CPU; the GPU's router
    ranks groups by their two best and refuses it in one line). Latent attention with its rope in adjacent pairs.
    Keys transformers does not read for this family, set to what it would not compute, are refused."""
    config = translated("deepseek_v2")
    assert (config.router_scoring, config.norm_topk_prob, config.routed_scaling_factor) == ("softmax", False, 1.5)
    assert config.attention == "mla" and config.rope_interleave and config.moe_layers == (1, 2)
    assert config.shared_expert_intermediate_size == 64 and not config.score_correction_bias and config.n_group == 1
    check_features(config, CupyBackend)
    grouped = translated("deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=2)
    assert (grouped.n_group, grouped.topk_group, grouped.group_ranking) == (4, 2, "max")
    check_features(grouped, NumpyBackend)
    with pytest.raises(UnsupportedModelError, match="groups of experts ranked by their best score"):
        check_features(grouped, CupyBackend)
    for change, refused in [(dict(topk_method="noaux_tc"), "topk_method"),
                            (dict(norm_topk_prob=True), "norm_topk_prob"), (dict(mlp_bias=True), "mlp_bias"),
                            (dict(scoring_func="sigmoid"), "scoring_func")]:
        with pytest.raises(UnsupportedModelError, match=f"{refused} .* is not supported"):
            translated("deepseek_v2", **change)


def test_glm4_moe_lite_takes_its_moe_layers_from_mlp_layer_types():
    """GLM-4.7-Flash names each layer dense or sparse (transformers' default: the first dense); it reads no
    first_k_dense_replace, so one that names another split is refused, and a malformed list is an invalid file."""
    assert translated("glm4_moe_lite").moe_layers == (0, 2)
    default = translated("glm4_moe_lite", mlp_layer_types=None)
    assert default.moe_layers == (1, 2) and default.attention == "mla" and default.intermediate_size == 96
    assert translated("glm4_moe_lite", mlp_layer_types=None, first_k_dense_replace=1).moe_layers == (1, 2)
    with pytest.raises(UnsupportedModelError, match="first_k_dense_replace 2 disagrees with mlp_layer_types"):
        translated("glm4_moe_lite", mlp_layer_types=None, first_k_dense_replace=2)
    with pytest.raises(CheckpointError, match="mlp_layer_types must list"):
        translated("glm4_moe_lite", mlp_layer_types=["dense", "moe", "sparse"])
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.5 is not an option of glm4_moe_lite"):
        translated("glm4_moe_lite", rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                     "partial_rotary_factor": 0.5})


def test_gpu_backend_captures_latent_attention_where_its_decode_kernel_takes_the_cache():
    """Latent attention's decode steps are captured in CUDA graphs where latent_attention takes the cache: DeepSeek-V3's
    widths (kv_lora_rank 512, rope 64) over a 16-bit or fp8 cache; other widths, or a float32 cache, run eagerly."""
    config = translated("deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64)
    check_features(config, CupyBackend)
    assert all(CupyBackend.captures(config, dtype) for dtype in ("bfloat16", "float16", "float8_e4m3"))
    assert not CupyBackend.captures(config, "float32")
    assert not CupyBackend.captures(translated("deepseek_v3", kv_lora_rank=256), "bfloat16")
    assert CupyBackend.captures(translated("glm4_moe"), "float32")
    check_features(config, NumpyBackend)


@pytest.mark.parametrize("arch", ["glm4_moe", "minimax_m2"])
def test_gpu_backend_runs_sigmoid_routing_groups_and_partial_rotary(arch):
    config = translated(arch)
    assert config.router_scoring == "sigmoid" and config.score_correction_bias
    assert config.rotary_dim < config.head_dim
    check_features(config, CupyBackend)


def test_gpu_backend_names_each_option_alone():
    config = translated("glm4_moe")
    plain = dataclasses.replace(config, router_scoring="softmax", score_correction_bias=False, n_group=1,
                                topk_group=1, routed_scaling_factor=1.0, rotary_dim=None)
    check_features(plain, CupyBackend)
    for change in (dict(rotary_dim=config.head_dim // 2), dict(routed_scaling_factor=2.0),
                   dict(router_scoring="sigmoid"), dict(router_bias=True), dict(n_group=4, topk_group=2),
                   dict(head_dim=256)):
        check_features(dataclasses.replace(plain, **change), CupyBackend)  # router.cu and the prologue take these
    for change in (dict(attention_sinks=True), dict(expert_bias=True), dict(swiglu_limit=7.0)):
        check_features(dataclasses.replace(plain, **change), CupyBackend)  # cupy_latent.py; the MoE kernels
    check_features(dataclasses.replace(plain, expert_bias=True, swiglu_limit=7.0, expert_dtype="int8"), CupyBackend)
    for change, words in ((dict(num_experts=2048, n_group=64, topk_group=2),
                           "more than 1024 routed experts, group-limited routing over more than 32 groups"),
                          (dict(head_dim=288), "head_dim 288")):
        with pytest.raises(UnsupportedModelError, match=words):
            check_features(dataclasses.replace(plain, **change), CupyBackend)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_gpu_backend_runs_the_other_families_as_before(arch):
    check_features(translate_config(hf_config(arch).to_dict(), {}, set(), "bfloat16", "bfloat16"), CupyBackend)


@pytest.mark.parametrize("arch,changes,words", [
    ("mixtral", dict(model_type="deepseek_v32", architectures=None), ["deepseek_v32", "indexer", "deepseek_v3"]),
    ("mixtral", dict(model_type="glm_moe_dsa", architectures=None), ["glm_moe_dsa", "indexer", "minimax_m2"]),
    ("deepseek_v3", dict(attention_bias=True), ["attention_bias", "Latent"]),
    ("minimax_m2", dict(scoring_func="softmax"), ["scoring_func", "sigmoid"]),
    ("deepseek_v3", dict(topk_method="greedy"), ["topk_method 'greedy'", "noaux_tc"]),
    ("deepseek_v3", dict(scoring_func="softmax"), ["scoring_func 'softmax'", "sigmoid"]),
    ("deepseek_v3", dict(moe_layer_freq=2), ["moe_layer_freq 2", "computes 1"]),
    ("minimax_m2", dict(use_qk_norm=False), ["use_qk_norm"]),
    ("minimax_m2", dict(qk_norm_type="per_head"), ["qk_norm_type", "per_layer"]),
    ("minimax_m2", dict(shared_intermediate_size=64), ["shared_intermediate_size"]),
    ("minimax_m2", dict(attn_type_list=[0, 1, 1]), ["attn_type_list", "linear-attention"]),
    ("glm4_moe", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}),
     ["partial_rotary_factor 0.1", "rotates 1 of head_dim 16"]),
])
def test_unsupported_variants_are_refused_in_one_line(arch, changes, words):
    with pytest.raises(UnsupportedModelError) as info:
        translated(arch, **changes)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_kimi_k2_configs_name_deepseek_v3():
    raw = dict(hf_config("deepseek_v3").to_dict(), model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    config = translate_config(raw, {}, set(), "bfloat16", "bfloat16")
    assert (config.architecture, config.attention) == ("deepseek_v3", "mla")


def test_group_options_are_checked():
    with pytest.raises(CheckpointError, match="n_group \\(3\\) must be a positive divisor of num_experts \\(8\\)"):
        translated("glm4_moe", n_group=3)
    with pytest.raises(CheckpointError, match="topk_group \\(3\\) must be between 1 and n_group \\(2\\)"):
        translated("glm4_moe", topk_group=3)
    with pytest.raises(CheckpointError, match="top_k \\(4\\) exceeds the experts of the topk_group"):
        translated("glm4_moe", n_group=4, topk_group=1, num_experts_per_tok=4)
    with pytest.raises(CheckpointError, match="fewer than two experts a group"):
        translated("glm4_moe", n_group=8, topk_group=8)
    config = translated("glm4_moe", n_shared_experts=2, first_k_dense_replace=2)
    assert (config.shared_expert_intermediate_size, config.moe_layers) == (64, (2,))
    rope = {"rope_type": "default", "rope_theta": 5e6}  # without its partial_rotary_factor, which would win
    assert translated("minimax_m2", rotary_dim=8, rope_parameters=rope).rotary_dim == 8
    assert translated("minimax_m2", rotary_dim=24, rope_parameters=rope).rotary_dim is None  # the whole head
