"""Expert formats (expert_codecs.py): each codec round-trips within its rounding bound, lays out the bytes it
documents, exports and loads through the native folder, computes on the CPU kernels as the NumPy reference does,
and a corrupt block, a mislabelled header or a format the GPU backend lacks is refused with one line."""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from colibri_stream.backends.cupy_backend import CupyBackend
from colibri_stream.backends.numpy_backend import NumpyBackend
from colibri_stream.checkpoint import (NUMPY_DTYPES, ModelFolder, default_model_path, expert_block_layout, read_config,
                                       write_config)
from colibri_stream.cli import main
from colibri_stream.errors import CheckpointError, ColibriError
from colibri_stream.expert_codecs import (FP8_BLOCK, Fp8Codec, Int4Codec, Int8Codec, Mxfp4Codec, PlainCodec,
                                           codec_of, dequantize_expert)
from colibri_stream.experts.cpu_executor import CpuExpertExecutor, numba, numpy_expert
from colibri_stream.experts.rates import cpu_expert_rates
from colibri_stream.loader import check_expert_format
from colibri_stream.plan import make_plan

CODECS = [PlainCodec("bfloat16"), PlainCodec("float16"), Int8Codec(), Int4Codec(32, False), Int4Codec(64, True),
          Int4Codec(128, False), Int4Codec(128, True), Fp8Codec("block"), Fp8Codec("channel")]
SHAPES = [(64, 256), (300, 77), (5, 130), (130, 3)]  # rows and columns off every group and tile boundary


def random_matrix(rng: np.random.Generator, shape: tuple[int, int], offset: float = 0.0) -> np.ndarray:
    return (rng.standard_normal(shape) / np.sqrt(shape[1]) + offset).astype(np.float32)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.describe())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("offset", [0.0, 0.05])  # centred, and every group of one sign (int4's zero points)
def test_each_codec_round_trips_within_its_rounding_bound(codec, shape, offset):
    weight = random_matrix(np.random.default_rng(shape[0]), shape, offset)
    parts = codec.quantize(weight)
    assert {k: (v.dtype, v.shape) for k, v in parts.items()} == {
        suffix: (NUMPY_DTYPES[dtype], shape) for suffix, dtype, shape in codec.matrix_tensors(*shape)}
    error = np.abs(codec.dequantize(parts, shape[1]) - weight)
    bound = codec.error_bound(weight)
    assert np.all(error <= bound), float(np.max(error - bound))
    if codec.name != "float32":
        assert error.max() > 0  # a lossy format rounds something


def test_int4_packs_the_even_channel_in_the_low_nibble_and_scales_follow_the_weights():
    codec = Int4Codec(32, False)
    weight = np.tile(np.arange(-7, 25, dtype=np.float32) % 15 - 7, (2, 1))  # [2, 32], max |w| 7: scale 1
    parts = codec.quantize(weight)
    codes = weight[0].astype(np.int64) + 8  # symmetric: code = w / scale + 8
    assert parts["_scale"].tolist() == [[1.0], [1.0]]
    assert parts[""][0, 0].tolist() == (codes[0::2] | codes[1::2] << 4).tolist()
    names = [s.name for s in expert_block_layout(_config(expert_dtype="int4", expert_group_size=32,
                                                          expert_zero_point=True))[0]]
    assert names == ["gate", "up", "down", "gate_scale", "up_scale", "down_scale", "gate_zero", "up_zero", "down_zero"]


def test_fp8_block_scales_are_deepseeks_weight_scale_inv():
    rng = np.random.default_rng(0)
    weight = random_matrix(rng, (300, 200))
    parts = Fp8Codec("block").quantize(weight)
    assert parts["_scale"].shape == (3, 2)  # [ceil(out / 128), ceil(in / 128)]
    tile = np.abs(weight[256:, 128:]).max()
    assert parts["_scale"][2, 1] == np.float32(tile / 448)  # the tile's largest value maps to e4m3's largest
    q = parts[""].astype(np.float32)
    expected = q * np.repeat(np.repeat(parts["_scale"], FP8_BLOCK, 0), FP8_BLOCK, 1)[:300, :200]
    np.testing.assert_array_equal(Fp8Codec("block").dequantize(parts, 200), expected)  # w = fp8 value * scale


MXFP4_SHAPES = [(64, 256), (5, 32), (130, 96)]
# OCP MXFP4's element values by code, as the spec (and transformers' FP4_VALUES) lists them
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def mxfp4_cases(rng: np.random.Generator, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """Weights that reach each part of mxfp4's rounding: ordinary ones, outliers (one block's largest value far above
    its others), all-zero rows, values below e8m0's smallest exponent, and values exactly halfway between codes."""
    plain = random_matrix(rng, shape)
    outliers = plain.copy()
    outliers[rng.integers(0, shape[0], 4), rng.integers(0, shape[1], 4)] = [40.0, -300.0, 1e-3, 7e4]
    zeros = plain.copy()
    zeros[::2] = 0
    tiny = plain * np.float32(2.0**-126)  # amax below 2**-124: floor(log2(amax)) - 2 clamps at e8m0's -127
    halfway = np.resize(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -7.0] * 3 + [4.0], np.float32), shape)
    return dict(plain=plain, outliers=outliers, zeros=zeros, tiny=tiny, halfway=halfway)


@pytest.mark.parametrize("shape", MXFP4_SHAPES)
def test_mxfp4_round_trips_within_its_rounding_bound(shape):
    codec = Mxfp4Codec()
    for case, weight in mxfp4_cases(np.random.default_rng(shape[0]), shape).items():
        parts = codec.quantize(weight)
        assert {k: (v.dtype, v.shape) for k, v in parts.items()} == {
            suffix: (NUMPY_DTYPES[dtype], shape) for suffix, dtype, shape in codec.matrix_tensors(*shape)}
        error = np.abs(codec.dequantize(parts, shape[1]) - weight)
        bound = codec.error_bound(weight)
        assert np.all(error <= bound), (case, float(np.max(error - bound)))
        assert np.max(error / np.where(bound > 0, bound, 1)) > 0.5, case  # the bound is not loose everywhere
    zeros = mxfp4_cases(np.random.default_rng(0), shape)["zeros"]
    assert not np.any(codec.dequantize(codec.quantize(zeros), shape[1])[::2])  # an all-zero block stays zero


def test_mxfp4_rounds_halfway_to_the_even_code_and_saturates():
    codec = Mxfp4Codec()
    # a block whose largest magnitude is 7 has exponent floor(log2 7) - 2 = 0: the values are e2m1's own
    row = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -5.0, 6.5, 0.3] + [0.0] * 20, np.float32)
    parts = codec.quantize(row[None])
    assert parts["_scale"].tolist() == [[127]]
    assert codec.dequantize(parts, 32)[0, :12].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0,
                                                             6.0, 0.5]
    parts = codec.quantize(np.full((1, 32), 0.1, np.float32))  # floor(log2 0.1) - 2 = -6: 0.1 / 2**-6 = 6.4 -> 6
    assert parts["_scale"].tolist() == [[121]] and codec.dequantize(parts, 32)[0, 0] == 6 * 2.0**-6


def test_mxfp4_dequantizes_hand_built_bytes_to_the_e2m1_values():
    codes = np.concatenate([np.arange(16), np.arange(16)[::-1]]).astype(np.uint8)  # [32] one block
    packed = np.array([codes[2 * j] | codes[2 * j + 1] << 4 for j in range(16)], np.uint8)  # even channel low
    scales = np.array([[127 + 3], [0], [127 - 10]], np.uint8)  # 2**3, 2**-127 (float32 subnormals), 2**-10
    values = Mxfp4Codec().dequantize({"": np.tile(packed, (3, 1, 1)), "_scale": scales}, 32)  # [3, 32]
    e2m1 = np.array(E2M1_VALUES, np.float64)[codes]
    for row, exponent in enumerate((3, -127, -10)):
        np.testing.assert_array_equal(values[row], e2m1 * 2.0**exponent)
        assert np.signbit(values[row]).tolist() == (codes >= 8).tolist()  # bit 3 the sign, -0.0 included
    assert values.dtype == np.float32
    nan = Mxfp4Codec().dequantize({"": packed[None, None], "_scale": np.array([[255]], np.uint8)}, 32)
    assert np.isnan(nan).all()  # e8m0's NaN scale


def test_codec_of_tells_int4_groups_of_32_from_mxfp4():
    rng = np.random.default_rng(0)
    int4, mxfp4 = expert(Int4Codec(32, False), 64, 32, rng), expert(Mxfp4Codec(), 64, 32, rng)
    assert int4["gate"].shape == mxfp4["gate"].shape == (32, 2, 16)  # the same packed codes
    assert codec_of(int4) == Int4Codec(32, False) and codec_of(mxfp4) == Mxfp4Codec()
    widths = {"gate": 64, "up": 64, "down": 32}
    for part, weight in dequantize_expert(mxfp4).items():
        np.testing.assert_array_equal(weight, Mxfp4Codec().dequantize({"": mxfp4[part],
                                                                        "_scale": mxfp4[part + "_scale"]},
                                                                       widths[part]))


def test_mxfp4_refuses_widths_that_are_not_multiples_of_32():
    codec = Mxfp4Codec()
    for call in (lambda: codec.matrix_tensors(4, 48), lambda: codec.quantize(np.ones((4, 48), np.float32))):
        with pytest.raises(ValueError, match="multiple of 32 input channels; this matrix has 48"):
            call()
    with pytest.raises(CheckpointError, match="mxfp4 experts need hidden_size and moe_intermediate_size multiples "
                                              "of 32, got 256 and 48"):
        _config(expert_dtype="mxfp4", moe_intermediate_size=48)


def _config(**changes):
    return dataclasses.replace(read_config(default_model_path()), **changes)


def expert(codec, hidden: int, inter: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    tensors = {}
    for name, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        tensors.update(codec.quantize_matrix(name, random_matrix(rng, shape)))
    return tensors


GROUPED_CASES = ([(codec, *shape) for codec in CODECS[3:] for shape in [(256, 64, 1), (130, 77, 5), (300, 200, 9)]]
                 + [(Mxfp4Codec(), *shape) for shape in [(256, 64, 1), (96, 160, 5), (320, 224, 9)]])  # widths of 32s


@pytest.mark.skipif(numba is None, reason="numba is not installed (the `cpu` extra)")
@pytest.mark.parametrize("codec,hidden,inter,tokens", GROUPED_CASES,
                         ids=[f"{c.describe()}-{h}x{i}-{t}" for c, h, i, t in GROUPED_CASES])
def test_the_grouped_kernel_matches_the_numpy_reference(codec, hidden, inter, tokens):
    rng = np.random.default_rng(hidden + tokens)
    tensors = expert(codec, hidden, inter, rng)
    assert codec_of(tensors).name == codec.name
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    executor = CpuExpertExecutor(num_threads=2, min_kernel_bytes=0)
    assert executor.computes(codec, tensors["gate"].dtype, 0)
    want = numpy_expert(x, tensors)
    np.testing.assert_allclose(executor.run(x, tensors), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    cut = inter // 2 | 1  # odd: down's columns split inside a byte of int4 codes
    part = executor.run(x, tensors, rows=(0, cut)) + executor.run(x, tensors, rows=(cut, inter))
    np.testing.assert_allclose(part, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())  # row ranges add up
    weights = sum(t.nbytes for t in tensors.values())
    per_row = tensors["down_scale"].nbytes if tensors["down_scale"].ndim == 1 else 0  # each part reads them whole
    assert executor.stats.cpu_bytes_read == 2 * weights + per_row  # the stored bytes, not float32's


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("codec", [Int4Codec(128, False), Mxfp4Codec(), Fp8Codec("block")], ids=lambda c: c.name)
def test_cpu_rate_probes_feed_the_hidden_size_whatever_the_codes_shape(codec, use_kernel):
    """The placement's probe of the CPU executor runs ones of the expert's hidden size (down's rows), not of its
    codes' second dimension (int4's and mxfp4's groups); an input of another width is refused, not read past."""
    if use_kernel and numba is None:
        pytest.skip("numba is not installed (the `cpu` extra)")
    tensors = expert(codec, 256, 128, np.random.default_rng(1))
    executor = CpuExpertExecutor(num_threads=2, use_kernel=use_kernel, min_kernel_bytes=0)
    read, flops = cpu_expert_rates(executor, tensors, 3 * 256 * 128)
    assert read > 0 and flops > 0
    with pytest.raises(ValueError, match="hidden size 256"):
        executor.run(np.ones((1, 224), np.float32), tensors)


def test_stored_bytes_per_expert_are_smaller_and_plan_counts_them():
    bf16, int8 = _config(expert_dtype="bfloat16"), _config()
    int4, fp8 = _config(expert_dtype="int4", expert_group_size=128), _config(expert_dtype="fp8", expert_scales="block")
    weight_bytes = {name: sum(s.nbytes for s in expert_block_layout(c)[0])
                    for name, c in (("bf16", bf16), ("int8", int8), ("int4", int4), ("fp8", fp8))}
    assert weight_bytes["bf16"] > 1.9 * weight_bytes["fp8"] and weight_bytes["bf16"] > 3 * weight_bytes["int4"]
    budget = 8 * 1 << 20
    slots = {name: make_plan(c, 0, "cpu", l2_cache_size=budget).host_slots for name, c in
             (("bf16", bf16), ("int4", int4))}
    blocks = {name: expert_block_layout(c)[1] for name, c in (("bf16", bf16), ("int4", int4))}
    layers = len(bf16.moe_layers)
    for name in slots:  # whole slots of the codec's block size per MoE layer, one staging block
        assert slots[name] == min(bf16.num_experts, (budget // blocks[name] - 1) // layers)
    assert slots["int4"] > slots["bf16"]


def test_config_refuses_parameters_of_another_format():
    for changes, words in [(dict(expert_dtype="int4"), "int4 experts need expert_group_size 32 or 64 or 128"),
                           (dict(expert_dtype="int4", expert_group_size=48), "got 48"),
                           (dict(expert_group_size=64), "expert_group_size and expert_zero_point are int4's"),
                           (dict(expert_dtype="fp8"), "fp8 experts need expert_scales block or channel"),
                           (dict(expert_scales="block"), "expert_scales is fp8's")]:
        with pytest.raises(CheckpointError, match=words):
            _config(**changes)


def test_the_gpu_backend_runs_every_expert_format():
    check_expert_format(_config(expert_dtype="mxfp4"), NumpyBackend)  # the reference runs every format
    for changes in (dict(expert_dtype="int4", expert_group_size=64), dict(expert_dtype="fp8", expert_scales="block"),
                    dict(expert_dtype="fp8", expert_scales="channel"), dict(), dict(expert_dtype="bfloat16"),
                    dict(expert_dtype="mxfp4")):
        check_expert_format(_config(**changes), CupyBackend)  # int8 (_config's default) is the shipped model's


# ----------------------------------------------------------------------------------------------------------------
# Through the folder: export, header, load, refusals
# ----------------------------------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
from tiny_models import build_hf_model  # noqa: E402

FORMATS = {"int4-g32-zero": ["--quantize", "int4", "--group-size", "32", "--int4-zero-point"],
           "int4-g128": ["--quantize", "int4"], "fp8-block": ["--quantize", "fp8"],
           "fp8-channel": ["--quantize", "fp8", "--fp8-scales", "channel"], "mxfp4": ["--quantize", "mxfp4"],
           "fp32": ["--dtype", "fp32"]}


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """A tiny qwen3_moe (H 64, I 32: below every group and tile) exported in each format by the CLI."""
    root = tmp_path_factory.mktemp("formats")
    build_hf_model("qwen3_moe", root / "hf")
    folders = {}
    for name, options in FORMATS.items():
        assert main(["export", str(root / "hf"), str(root / name), "--quiet", *options]) == 0
        folders[name] = root / name
    return folders


def experts_header(path: Path) -> dict:
    data = path.read_bytes()
    json_len = struct.unpack_from("<I", data, 12)[0]
    return json.loads(data[32: 32 + json_len])


def test_the_header_records_the_format_and_its_parameters(exports):
    headers = {name: experts_header(folder / "experts.bin") for name, folder in exports.items()}
    assert headers["int4-g32-zero"]["params"] == {"group_size": 32, "zero_point": True}
    assert headers["int4-g128"]["params"] == {"group_size": 128, "zero_point": False}
    assert headers["fp8-block"]["params"] == {"scales": "block", "block": [128, 128]}
    assert headers["fp8-channel"]["params"] == {"scales": "channel"}
    assert "params" not in headers["fp32"]  # unparameterized formats keep the header older files have
    assert headers["mxfp4"]["dtype"] == "mxfp4" and "params" not in headers["mxfp4"]  # blocks of 32, always
    assert [(t["name"], t["dtype"], t["shape"]) for t in headers["mxfp4"]["tensors"]][::3] == [
        ("gate", "uint8", [32, 2, 16]), ("gate_scale", "uint8", [32, 2])]  # qwen3_moe's I 32, H 64
    config = read_config(exports["int4-g32-zero"])
    assert (config.expert_dtype, config.expert_group_size, config.expert_zero_point) == ("int4", 32, True)


def test_exported_experts_are_the_source_within_the_formats_bound(exports):
    reference = ModelFolder(exports["fp32"])  # the float32 source as it is
    for name in ("int4-g32-zero", "int4-g128", "fp8-block", "fp8-channel", "mxfp4"):
        folder = ModelFolder(exports[name], verify=True)
        for layer in folder.config.moe_layers:
            for e in range(folder.config.num_experts):
                stored, source = folder.experts.tensors(layer, e), reference.experts.tensors(layer, e)
                codec = codec_of(stored)
                for matrix, weight in dequantize_expert(stored).items():
                    original = source[matrix].astype(np.float32)
                    assert np.all(np.abs(weight - original) <= codec.error_bound(original))


@pytest.mark.skipif(numba is None, reason="numba is not installed (the `cpu` extra)")
def test_the_numpy_backend_computes_stored_experts_as_their_dequantized_weights(exports):
    from colibri_stream.experts.store import Float32ExpertStore, MappedExpertStore
    from colibri_stream.loader import load_model

    rng = np.random.default_rng(0)
    for name in ("int4-g32-zero", "int4-g128", "fp8-block", "fp8-channel", "mxfp4"):
        folder = ModelFolder(exports[name])
        config = folder.config
        backend = NumpyBackend(CpuExpertExecutor(num_threads=2, min_kernel_bytes=0))  # the kernels, tiny or not
        x = rng.standard_normal((7, config.hidden_size)).astype(np.float32)  # [T, H]
        ids = np.stack([rng.choice(config.num_experts, config.top_k, replace=False) for _ in range(7)])  # [T, k]
        weights = rng.uniform(0.1, 1, ids.shape).astype(np.float32)  # [T, k]
        stored = MappedExpertStore(folder.experts)
        got = backend.routed_experts(x, weights, ids, 1, stored)  # from the stored bytes
        want = backend.routed_experts(x, weights, ids, 1, Float32ExpertStore(stored))  # dequantized, then NumPy
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert isinstance(load_model(str(exports[name])).store, Float32ExpertStore)  # small: widened once


def rewrite_header(path: Path, edit) -> None:
    """Apply `edit` to experts.bin's JSON header (same length) and fix its checksum, as a mislabelled file."""
    data = bytearray(path.read_bytes())
    json_len, num_entries = struct.unpack_from("<II", data, 12)
    header = edit(bytes(data[32: 32 + json_len]))
    assert len(header) == json_len
    data[32: 32 + json_len] = header
    index_start = -(-(32 + json_len) // 8) * 8
    index = bytes(data[index_start: index_start + num_entries * 32])
    struct.pack_into("<I", data, 20, zlib.crc32(header + index) & 0xFFFFFFFF)
    path.write_bytes(bytes(data))


def test_an_unknown_format_or_a_mislabelled_header_is_refused(exports, tmp_path):
    import shutil

    folder = Path(shutil.copytree(exports["int4-g32-zero"], tmp_path / "m"))
    rewrite_header(folder / "experts.bin", lambda h: h.replace(b'"int4"', b'"int3"'))
    with pytest.raises(CheckpointError, match="stores experts as 'int3', a format this Colibri does not read"):
        ModelFolder(folder)
    rewrite_header(folder / "experts.bin", lambda h: h.replace(b'"int3"', b'"int4"').replace(b'"group_size": 32',
                                                                                              b'"group_size": 64'))
    with pytest.raises(CheckpointError, match=r"differs in params.*groups of 32.*group_size 64"):
        ModelFolder(folder)
    config = read_config(exports["int4-g32-zero"])
    write_config(folder, dataclasses.replace(config, expert_zero_point=False))  # config.json says symmetric
    shutil.copy(exports["int4-g32-zero"] / "experts.bin", folder / "experts.bin")
    with pytest.raises(CheckpointError, match="does not match config.json"):
        ModelFolder(folder)


def test_a_corrupt_quantized_block_is_refused_naming_it(exports, tmp_path):
    import shutil

    for name in ("int4-g128", "fp8-block"):
        folder = Path(shutil.copytree(exports[name], tmp_path / name))
        opened = ModelFolder(folder)
        entry = opened.experts.entry(1, 3)
        scale = next(s for s in opened.experts.slots if s.name == "down_scale")
        opened.experts.close()
        with open(folder / "experts.bin", "r+b") as f:  # a flipped bit in a scale
            f.seek(int(entry["offset"]) + scale.offset)
            byte = f.read(1)
            f.seek(int(entry["offset"]) + scale.offset)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(CheckpointError, match="expert 3 of layer 1 fails its checksum"):
            ModelFolder(folder, verify=True)


def test_export_options_of_another_format_are_refused(exports, tmp_path):
    from colibri_stream.export import export_model

    hf = exports["fp32"].parent / "hf"
    for options, words in [(dict(quantize="int8", group_size=64), "--group-size and --int4-zero-point"),
                           (dict(zero_point=True), "--group-size and --int4-zero-point"),
                           (dict(quantize="int4", fp8_scales="block"), "--fp8-scales is an option of --quantize fp8"),
                           (dict(quantize="int4", group_size=16), "int4 group size 16 is not one of 32, 64, 128"),
                           (dict(quantize="nf4"), "quantize 'nf4' is not supported")]:
        with pytest.raises(ColibriError, match=words):
            export_model(hf, tmp_path / "x", progress=False, **options)


@pytest.mark.skipif(numba is None, reason="numba is not installed (the `cpu` extra)")
@pytest.mark.parametrize("lookup", ["host", "bits"])
def test_e2m1_codes_become_twice_their_values_in_vector_code(lookup):
    """The CPU kernel's e2m1 decode of 16 codes at once: the host's byte table lookup (x86-64, arm64), and the
    decode from the code's bits that other hosts take, both give twice the value of every code."""
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    from colibri_stream.experts import cpu_grouped

    if lookup == "host" and cpu_grouped._TABLE_LOOKUP is None:
        pytest.skip("this host has no byte table lookup: the bits case covers it")
    name = cpu_grouped._TABLE_LOOKUP if lookup == "host" else None

    @intrinsic
    def doubled(typingctx, codes, out):
        def codegen(context, builder, signature, args):
            source = context.make_array(signature.args[0])(context, builder, args[0]).data
            target = context.make_array(signature.args[1])(context, builder, args[1]).data
            vector = builder.load(builder.bitcast(source, ir.VectorType(ir.IntType(8), 16).as_pointer()), align=1)
            values = cpu_grouped._e2m1_doubled(builder, vector, name)
            builder.store(values, builder.bitcast(target, values.type.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(codes, out), codegen

    @njit
    def decode(codes, out):
        doubled(codes, out)

    out = np.zeros(16, np.float32)
    decode(np.arange(16, dtype=np.uint8), out)
    np.testing.assert_array_equal(out, 2 * np.array(E2M1_VALUES, np.float32))
