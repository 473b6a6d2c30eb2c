"""One codec per routed-expert format: its tensors in a block, its quantizer and its NumPy dequantizer.

An expert is three matrices, gate [I, H], up [I, H] and down [H, I] ([out, in]: a row per output channel). A codec
says how one matrix is stored (`matrix_tensors`: the weights, then scales, then zero points), and the block holds
the three weights, then the three scales, then the three zero points (`expert_tensors`; checkpoint.py adds the
offsets). `dequantize` (float32, the reference every kernel is compared with) and `quantize` (round to nearest
from float32) are inverse up to the format's rounding, whose bound `error_bound` states per element.

    bfloat16, float16, float32   the values themselves
    int8    q [out, in] int8, scale [out] float32: w = q * scale, scale = max|row| / 127
    int4    q [out, ceil(in/g), g/2] uint8, two values a byte, the even input channel in the low nibble;
            scale [out, ceil(in/g)] float32 and, asymmetric, zero [out, ceil(in/g)] uint8 per group of g (32, 64
            or 128) input channels: w = (q - zero) * scale, zero 8 when symmetric. The last group of a row whose
            length is not a multiple of g is padded (its padding codes are never read); a row shorter than g is
            one group of its own length (rounded up to even).
    fp8     q [out, in] float8 e4m3 (finite, +-448); scale per 128 x 128 tile, [ceil(out/128), ceil(in/128)]
            float32 (DeepSeek-V3's `weight_scale_inv`), or per output channel, [out] float32: w = q * scale
    mxfp4   q [out, in/32, 16] uint8, two e2m1 codes a byte (the even input channel in the low nibble, as int4), and
            scale [out, in/32] uint8, an e8m0 exponent per 32 input channels (OCP Microscaling MXFP4, gpt-oss's
            experts): w = E2M1[q] * 2**(scale - 127); `in` must be a multiple of 32

A biased expert (ModelConfig.expert_bias) adds gate_bias [I], up_bias [I] and down_bias [H] float32 after them
in every format (`expert_bias_tensors`). An expert's tensors name their codec (`codec_of`): the weights' dtype,
int4's group size in the packed shape, whether zero points or tiles of scales are there, and the scales' dtype
(int4's float32, mxfp4's uint8 exponents). Why round to nearest: docs/EXPERT_FORMATS.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .config import FP8_SCALES, MXFP4_BLOCK, ModelConfig

MATRICES = ("gate", "up", "down")
# every weight tensor an expert block may hold, in block order: the matrices, their scales, their zero points
WEIGHT_TENSORS = tuple(m + suffix for suffix in ("", "_scale", "_zero") for m in MATRICES)
EXPERT_BIASES = ("gate_bias", "up_bias", "down_bias")  # float32, the same in every format
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0  # e4m3's largest finite value
FP8_BLOCK = 128  # rows and columns of one fp8 scale tile
INT4_SYMMETRIC_ZERO = 8  # the code of 0.0 in a symmetric int4 group (codes 0 .. 15 stand for -8 .. 7)
INT8_MAX = 127
# error_bound's margin over half a step: bf16 weights often lie exactly half a step between two codes, where the
# float32 arithmetic of quantizing and dequantizing lands a few ulps past it (int8, int4 with zero points)
BOUND_SLACK = 1 + 1e-5
# mxfp4's element values by code: bit 3 the sign, bits 0-2 an e2m1 magnitude (2 exponent bits, 1 mantissa bit)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
E2M1_EMAX = 2  # the exponent of e2m1's largest magnitude, 6 = 1.5 * 2**2
E8M0_BIAS = 127  # an mxfp4 scale byte s stands for 2**(s - 127)
E8M0_NAN = 255  # the scale byte the spec reserves for NaN
_E2M1_MIDPOINTS = (E2M1[1:8] + E2M1[:7]).astype(np.float64) / 2  # [7] between neighbouring magnitudes
_PLAIN = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes 0..15 [..., 2n] -> [..., n], two a byte, the even one in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes of two 4-bit codes [..., n] -> the codes uint8 [..., 2n], each byte's low nibble first."""
    return np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def _safe_scale(amax: np.ndarray, levels: float) -> np.ndarray:
    """amax / levels, 1 where amax is 0 (an all-zero group), as float32."""
    return np.where(amax > 0, amax / levels, 1.0).astype(np.float32)


class ExpertCodec(ABC):
    """How one expert format stores a matrix [out, in]; subclasses are the formats."""

    name: str  # config.json's expert_dtype and experts.bin's "dtype"
    # The CPU executor's kernel for the format: "plain" (cpu_executor.expert_kernel: a cast, a per-row scale),
    # "grouped" (cpu_grouped.grouped_expert_kernel: scales per group or tile), None (NumPy only).
    cpu_kernel: str | None = "plain"
    sliceable = True  # an expert's intermediate rows are views of its tensors (cpu_executor.intermediate_rows)

    def row_group(self, inter: int) -> int:
        """Intermediate rows that share a scale (or a byte of codes) along down's input axis or gate's and up's
        output axis, in an expert of `inter` intermediate rows: an expert cut in two by its rows (cut_layout.py)
        is cut at a multiple of it, so each part holds whole groups of its codes and scales."""
        return 1

    def params(self) -> dict:
        """The format's parameters as experts.bin's header records them (nothing for unparameterized formats)."""
        return {}

    def describe(self) -> str:
        """The format and its parameters in words (`colibri inspect`)."""
        return self.name

    @abstractmethod
    def matrix_tensors(self, out: int, inp: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """(suffix, dtype, shape) of the tensors that store one matrix [out, inp]: "" first, then "_scale", "_zero"."""

    @abstractmethod
    def quantize(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        """float32 [out, in] -> its stored tensors by suffix."""

    @abstractmethod
    def dequantize(self, parts: dict[str, np.ndarray], inp: int) -> np.ndarray:
        """Stored tensors by suffix -> the matrix as float32 [out, inp]."""

    @abstractmethod
    def error_bound(self, weight: np.ndarray) -> np.ndarray:
        """The largest |dequantize(quantize(w)) - w| the format allows for each element of `weight`.  # [out, in]"""

    def expert_tensors(self, hidden: int, inter: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every tensor of one expert block in block order."""
        shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        per_matrix = {m: self.matrix_tensors(*shapes[m]) for m in MATRICES}
        tensors = []
        for kind in range(len(per_matrix["gate"])):  # weights, then scales, then zero points
            for m in MATRICES:
                suffix, dtype, shape = per_matrix[m][kind]
                tensors.append((m + suffix, dtype, shape))
        return tensors

    def quantize_matrix(self, name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
        """float32 matrix `name` (gate, up or down) -> its block tensors by name."""
        return {name + suffix: array for suffix, array in self.quantize(weight).items()}

    def dequantize_expert(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """An expert's stored tensors -> gate [I, H], up [I, H], down [H, I] float32, and its biases as stored."""
        inter, hidden = tensors["gate"].shape[0], tensors["down"].shape[0]
        widths = {"gate": hidden, "up": hidden, "down": inter}
        matrices = {m: self.dequantize({k[len(m):]: v for k, v in tensors.items()
                                        if (k == m or k.startswith(m + "_")) and k not in EXPERT_BIASES}, widths[m])
                    for m in MATRICES}
        return matrices | {name: tensors[name] for name in EXPERT_BIASES if name in tensors}


@dataclass(frozen=True)
class PlainCodec(ExpertCodec):
    """bfloat16, float16 or float32 values, stored as they are."""

    name: str

    def matrix_tensors(self, out, inp):
        return [("", self.name, (out, inp))]

    def quantize(self, weight):
        return {"": weight.astype(_PLAIN[self.name])}

    def dequantize(self, parts, inp):
        return parts[""].astype(np.float32, copy=False)  # float32 already (a widened cache): no copy

    def error_bound(self, weight):
        if self.name == "float32":
            return np.zeros_like(weight)
        mantissa = {"bfloat16": 8, "float16": 11}[self.name]  # significant bits; half an ulp of each value
        return np.abs(weight) * 2.0**-mantissa + (0 if self.name == "bfloat16" else 2.0**-25)


@dataclass(frozen=True)
class Int8Codec(ExpertCodec):
    """Symmetric int8 with one float32 scale per output channel (row): max|row| maps to +-127."""

    name = "int8"

    def matrix_tensors(self, out, inp):
        return [("", "int8", (out, inp)), ("_scale", "float32", (out,))]

    def quantize(self, weight):
        scale = _safe_scale(np.max(np.abs(weight), axis=1), INT8_MAX)  # [out]
        q = np.clip(np.rint(weight / scale[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)  # [out, in]
        return {"": q, "_scale": scale}

    def dequantize(self, parts, inp):
        return parts[""].astype(np.float32) * parts["_scale"][:, None]

    def error_bound(self, weight):
        scale = _safe_scale(np.max(np.abs(weight), axis=1), INT8_MAX)
        return np.broadcast_to(scale[:, None] * 0.5 * BOUND_SLACK, weight.shape)


@dataclass(frozen=True)
class Int4Codec(ExpertCodec):
    """4-bit integers with a float32 scale (and, asymmetric, a uint8 zero point) per group of input channels
    (config.INT4_GROUP_SIZES, checked by ModelConfig)."""

    group_size: int
    zero_point: bool
    name = "int4"
    cpu_kernel = "grouped"
    sliceable = False

    def params(self):
        return {"group_size": self.group_size, "zero_point": self.zero_point}

    def describe(self):
        return f"int4, groups of {self.group_size}, {'asymmetric (zero points)' if self.zero_point else 'symmetric'}"

    def row_group(self, inter):
        return self.group_width(inter)  # down's groups run along the intermediate rows

    def group_width(self, inp: int) -> int:
        """Input channels per group of a matrix with `inp` columns: the group size, or the whole row (rounded up to
        even) when it is shorter. Each matrix's packed shape [out, groups, width / 2] records it."""
        return min(self.group_size, inp + inp % 2)

    def matrix_tensors(self, out, inp):
        width = self.group_width(inp)
        groups = -(-inp // width)
        tensors = [("", "uint8", (out, groups, width // 2)), ("_scale", "float32", (out, groups))]
        return tensors + ([("_zero", "uint8", (out, groups))] if self.zero_point else [])

    def _groups(self, weight: np.ndarray) -> np.ndarray:
        """[out, in] -> [out, groups, width], the last group padded with the row's last value (no new extreme)."""
        out, inp = weight.shape
        width = self.group_width(inp)
        padded = np.pad(weight, ((0, 0), (0, -inp % width)), mode="edge")
        return padded.reshape(out, -1, width)

    def _scale_zero(self, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per group: scale [out, groups] float32 and the code of 0.0 [out, groups] (float)."""
        if not self.zero_point:
            return _safe_scale(np.max(np.abs(groups), axis=2), 7), np.float32(INT4_SYMMETRIC_ZERO)
        # the range includes 0 (as GPTQ's), so the zero point is a code 0 .. 15 and no value is clipped
        low, high = np.minimum(np.min(groups, axis=2), 0), np.maximum(np.max(groups, axis=2), 0)
        scale = _safe_scale(high - low, 15)
        return scale, np.clip(np.rint(-low / scale), 0, 15)

    def quantize(self, weight):
        groups = self._groups(weight)  # [out, groups, g]
        scale, zero = self._scale_zero(groups)
        zero = np.broadcast_to(zero, scale.shape)
        codes = np.clip(np.rint(groups / scale[..., None]) + zero[..., None], 0, 15).astype(np.uint8)
        parts = {"": pack_nibbles(codes), "_scale": scale}
        if self.zero_point:
            parts["_zero"] = zero.astype(np.uint8)
        return parts

    def dequantize(self, parts, inp):
        packed = parts[""]  # [out, groups, g/2]
        codes = unpack_nibbles(packed)  # [out, groups, g]
        zero = parts["_zero"][..., None] if self.zero_point else INT4_SYMMETRIC_ZERO
        values = (codes.astype(np.float32) - zero) * parts["_scale"][..., None]
        return values.reshape(packed.shape[0], -1)[:, :inp]

    def error_bound(self, weight):
        scale, _ = self._scale_zero(self._groups(weight))  # [out, groups]
        per_column = np.repeat(scale, self.group_width(weight.shape[1]), axis=1)[:, : weight.shape[1]]
        return per_column * 0.5 * BOUND_SLACK


@dataclass(frozen=True)
class Fp8Codec(ExpertCodec):
    """float8 e4m3 values times a float32 scale per 128 x 128 tile or per output channel."""

    scales: str  # "block" or "channel"
    name = "fp8"
    cpu_kernel = "grouped"
    sliceable = False

    def __post_init__(self):
        if self.scales not in FP8_SCALES:
            raise ValueError(f"fp8 scales {self.scales!r} is not one of {FP8_SCALES}")

    def params(self):
        return {"scales": "block", "block": [FP8_BLOCK, FP8_BLOCK]} if self.scales == "block" else {"scales": "channel"}

    def row_group(self, inter):
        return FP8_BLOCK if self.scales == "block" else 1

    def describe(self):
        return "fp8 e4m3, " + ("a scale per 128x128 tile" if self.scales == "block" else "a scale per output channel")

    def matrix_tensors(self, out, inp):
        if self.scales == "channel":
            return [("", "float8_e4m3fn", (out, inp)), ("_scale", "float32", (out,))]
        return [("", "float8_e4m3fn", (out, inp)), ("_scale", "float32", (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)))]

    def _stored_scale(self, weight: np.ndarray) -> np.ndarray:
        """The scale tensor of `weight`: [out] per channel, [ceil(out/128), ceil(in/128)] per tile."""
        if self.scales == "channel":
            return _safe_scale(np.max(np.abs(weight), axis=1), FP8_MAX)
        out, inp = weight.shape
        padded = np.pad(np.abs(weight), ((0, -out % FP8_BLOCK), (0, -inp % FP8_BLOCK)))
        tiles = padded.reshape(padded.shape[0] // FP8_BLOCK, FP8_BLOCK, padded.shape[1] // FP8_BLOCK, FP8_BLOCK)
        return _safe_scale(tiles.max(axis=(1, 3)), FP8_MAX)

    def _per_element(self, scale: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """The stored scale spread over the matrix's elements.  # [out, in]"""
        if self.scales == "channel":
            return np.broadcast_to(scale[:, None], shape)
        return np.repeat(np.repeat(scale, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[: shape[0], : shape[1]]

    def quantize(self, weight):
        scale = self._stored_scale(weight)
        q = np.clip(weight / self._per_element(scale, weight.shape), -FP8_MAX, FP8_MAX).astype(FP8)  # nearest even
        return {"": q, "_scale": scale}

    def dequantize(self, parts, inp):
        q = parts[""]
        return q.astype(np.float32) * self._per_element(parts["_scale"], q.shape)

    def error_bound(self, weight):
        # e4m3 keeps 4 significant bits (half an ulp: at most 2**-4 of the value) down to 2**-6; below, subnormal
        # steps of 2**-9 (half: 2**-10), both in units of the scale
        scale = self._per_element(self._stored_scale(weight), weight.shape)
        return (np.abs(weight) * 2.0**-4 + scale * 2.0**-10) * BOUND_SLACK


@dataclass(frozen=True)
class Mxfp4Codec(ExpertCodec):
    """OCP Microscaling MXFP4: e2m1 values, two a byte, times a power of two shared by each 32 input channels and
    stored as an e8m0 exponent byte (gpt-oss's experts). On the CPU, cpu_grouped.py's kernel decodes it."""

    name = "mxfp4"
    cpu_kernel = "grouped"
    sliceable = False

    def describe(self):
        return f"mxfp4 (e2m1, an e8m0 scale per {MXFP4_BLOCK} input channels)"

    def row_group(self, inter):
        return MXFP4_BLOCK

    def matrix_tensors(self, out, inp):
        if inp % MXFP4_BLOCK:
            raise ValueError(f"mxfp4 stores rows of a multiple of {MXFP4_BLOCK} input channels; this matrix has {inp}")
        blocks = inp // MXFP4_BLOCK
        return [("", "uint8", (out, blocks, MXFP4_BLOCK // 2)), ("_scale", "uint8", (out, blocks))]

    def _exponents(self, weight: np.ndarray) -> np.ndarray:
        """Each block's shared exponent e (w = e2m1 value * 2**e) as the OCP spec chooses it: floor(log2(amax))
        - 2, which puts the block's largest magnitude in e2m1's top binade [4, 8) (above 6 it saturates),
        clamped to e8m0's -127 .. 127 (-127 for an all-zero block).  # [out, in/32] int64"""
        self.matrix_tensors(*weight.shape)  # refuses a width that is not a multiple of 32
        amax = np.max(np.abs(weight.reshape(weight.shape[0], -1, MXFP4_BLOCK)), axis=2)
        _, exponent = np.frexp(amax)  # amax = m * 2**exponent with m in [0.5, 1): floor(log2(amax)) = exponent - 1
        exponent = np.where(amax > 0, exponent.astype(np.int64) - 1 - E2M1_EMAX, -E8M0_BIAS)
        return np.clip(exponent, -E8M0_BIAS, E8M0_BIAS)

    def quantize(self, weight):
        exponent = self._exponents(weight)
        # in units of the block's 2**e, exactly (float64, a power of two)
        scaled = weight.reshape(*exponent.shape, MXFP4_BLOCK) * np.ldexp(1.0, -exponent)[..., None]  # [out, in/32, 32]
        magnitude = np.abs(scaled)
        # the nearest magnitude's code, the lower one at a tie, 7 (6) past the last midpoint: saturated
        code = np.searchsorted(_E2M1_MIDPOINTS, magnitude, side="left")
        tie = magnitude == _E2M1_MIDPOINTS[np.minimum(code, len(_E2M1_MIDPOINTS) - 1)]
        code = code + (tie & (code % 2 == 1))  # ties to the even code
        codes = (code | np.where(scaled < 0, 8, 0)).astype(np.uint8)
        return {"": pack_nibbles(codes), "_scale": (exponent + E8M0_BIAS).astype(np.uint8)}

    def dequantize(self, parts, inp):
        scale = parts["_scale"]  # [out, in/32]
        # exact in float32 down to 2**-128 (0.5 * 2**-127, a subnormal); beyond float32's range (exponents 126 and
        # 127 with the larger magnitudes) inf, and the NaN scale's blocks NaN
        with np.errstate(over="ignore"):
            values = np.ldexp(E2M1[unpack_nibbles(parts[""])], scale[..., None].astype(np.int32) - E8M0_BIAS)
        values[scale == E8M0_NAN] = np.nan
        return values.reshape(scale.shape[0], -1)

    def error_bound(self, weight):
        unit = np.ldexp(1.0, self._exponents(weight))[..., None]  # 2**e [out, in/32, 1]
        magnitude = np.abs(weight.reshape(*unit.shape[:2], MXFP4_BLOCK)) / unit
        # half of e2m1's spacing at each magnitude (0.5 below 2, 1 below 4, 2 from 4 to 6), past 6 the saturation
        half_step = np.where(magnitude < 2, 0.25, np.where(magnitude < 4, 0.5, 1.0))
        bound = np.where(magnitude > 6, magnitude - 6, half_step) * unit * BOUND_SLACK
        return bound.reshape(weight.shape).astype(np.float32)


def expert_bias_tensors(hidden: int, inter: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of a biased expert's biases, after its codec's tensors in the block."""
    return [("gate_bias", "float32", (inter,)), ("up_bias", "float32", (inter,)), ("down_bias", "float32", (hidden,))]


def expert_codec(config: ModelConfig) -> ExpertCodec:
    """The codec of `config`'s routed experts (expert_dtype and its parameters, checked by ModelConfig)."""
    name = config.expert_dtype
    if name == "int4":
        return Int4Codec(config.expert_group_size, config.expert_zero_point)
    if name == "fp8":
        return Fp8Codec(config.expert_scales)
    if name == "int8":
        return Int8Codec()
    if name == "mxfp4":
        return Mxfp4Codec()
    return PlainCodec(name)


def codec_of(tensors: dict[str, np.ndarray]) -> ExpertCodec:
    """The codec whose tensors `tensors` are (an expert as ExpertFile.unpack gives it, or widened to float32)."""
    gate = tensors["gate"]
    if gate.dtype == np.uint8 and gate.ndim == 3 and tensors["gate_scale"].dtype == np.uint8:
        return Mxfp4Codec()  # e8m0 exponents; int4's packed codes of groups of 32 have the same shape, float32 scales
    if gate.dtype == np.uint8 and gate.ndim == 3:
        # gate's group width as its packed shape records it (the whole row where H is below the group size);
        # dequantizing and the kernels read each matrix's own width from its shape
        return Int4Codec(2 * gate.shape[2], "gate_zero" in tensors)
    if gate.dtype == FP8:
        return Fp8Codec("block" if tensors["gate_scale"].ndim == 2 else "channel")
    if gate.dtype == np.int8:
        return Int8Codec()
    for name, dtype in _PLAIN.items():
        if gate.dtype == dtype:
            return PlainCodec(name)
    raise ValueError(f"no expert format stores its gate as {gate.dtype}{list(gate.shape)}")


def dequantize_expert(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """gate [I, H], up [I, H], down [H, I] float32 of an expert's stored tensors (the NumPy reference)."""
    return codec_of(tensors).dequantize_expert(tensors)
