"""The CPU expert kernel for the formats with scales per group or tile (int4, fp8, mxfp4; expert_codecs.py).

`grouped_expert_kernel` computes down(silu(gate x) * up x) straight from the stored bytes: each thread takes a
range of weight rows; for each row it decodes the row into a float32 buffer of one row (L1-resident: int4 codes
minus the group's zero point, low nibbles to the buffer's first half and high nibbles to its second; mxfp4 codes
the same way, each nibble's e2m1 value from a table; fp8 bytes by shifting their bits into a float32's; times the
scale of the group or tile, mxfp4's e8m0 exponent byte as its power of two), then multiplies it with the tokens,
four at a time, laid out as the buffer is (`_paired`). One int4 or mxfp4 token (decode) skips the buffer: each
row's codes multiply the token as they are (int4's codes, twice mxfp4's e2m1 values by a table lookup), per
group, two rows a pass (`_code_dots`; whole groups in vector code of our own, `_int4_pair_groups` and
`_mxfp4_pair_groups`). Each weight byte is read once per call, and no float32
copy of the expert is made. Every matrix is passed as a 2D uint8 view of its bytes, [out, stored bytes per row], with
its scales as [scale rows, scale columns] float32 (mxfp4: uint8 exponents) and zero points as [out, groups] uint8
([0, 0]: none). A weight (o, c) takes scale[o // rows_per_scale, c // cols_per_scale]: int4 1 x group width,
mxfp4 1 x 32, fp8 tiles 128 x 128, fp8 channels 1 x (any width; CHANNEL_COLUMNS).
"""

from __future__ import annotations

import math
import platform

import numpy as np

from ..config import MXFP4_BLOCK
from ..expert_codecs import (E2M1, E8M0_BIAS, FP8_BLOCK, INT4_SYMMETRIC_ZERO, ExpertCodec, Fp8Codec, Int4Codec,
                             Mxfp4Codec)
from .jit import CHUNKS_PER_THREAD, FASTMATH, gated, jit, numba

INT4, FP8_CODES, MXFP4 = 0, 1, 2  # `kind`: how a row's bytes hold its values
CHANNEL_COLUMNS = 1 << 30  # cols_per_scale of a per-row scale: every column of a row shares it
# Below these many tokens int4 and mxfp4 rows multiply the tokens straight from their codes (a group's sum of code
# values times the token, less int4's zero point times the token's group sum); from them on a decoded float32 row
# serves four tokens at a time. Where each path is the faster one, measured: docs/CPU_EXPERTS.md (mxfp4's rows are
# decoded in vector code, so its decoded path wins sooner than int4's).
DIRECT_INT4_TOKENS = 8
DIRECT_MXFP4_TOKENS = 3
# Bytes of int4 codes one step of _int4_pair_groups' vector code takes (32 weights: two vectors of 16 float32 lanes,
# one AVX-512 register each; two AVX2 registers or four NEON ones where the CPU has narrower vectors).
VECTOR_BYTES = 16


def kernel_arguments(codec: ExpertCodec, tensors: dict[str, np.ndarray]) -> tuple:
    """The kernel's arguments for one expert's tensors: kind, then per matrix (gate, up, down) its bytes, scales,
    zero points, rows and columns per scale."""
    if isinstance(codec, Int4Codec):
        kind = INT4
    elif isinstance(codec, Fp8Codec):
        kind = FP8_CODES
    elif isinstance(codec, Mxfp4Codec):
        kind = MXFP4
    else:
        raise ValueError(f"the grouped CPU kernel does not compute {codec.describe()} experts")
    arguments: list = [kind]
    no_zero = np.zeros((0, 0), np.uint8)
    for name in ("gate", "up", "down"):
        weight, scale = tensors[name], tensors[name + "_scale"]
        rows = weight.shape[0]
        data = weight.reshape(rows, -1).view(np.uint8)  # [out, bytes per row]
        if kind == INT4:  # [out, groups, width / 2]: a scale per group of `width` columns
            per_scale = (1, 2 * weight.shape[2])
        elif kind == MXFP4:  # [out, in / 32, 16]: an exponent per 32 columns
            per_scale = (1, MXFP4_BLOCK)
        elif scale.ndim == 2:
            per_scale = (FP8_BLOCK, FP8_BLOCK)
        else:
            per_scale, scale = (1, CHANNEL_COLUMNS), scale.reshape(rows, 1)
        zero = tensors.get(name + "_zero", no_zero)
        arguments += [np.ascontiguousarray(data), np.ascontiguousarray(scale), np.ascontiguousarray(zero), *per_scale]
    return tuple(arguments)


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    _REASSOC = tuple(sorted(FASTMATH))  # the flags of the vector code's float operations

    @intrinsic
    def _fp8_bits(typingctx, byte):
        """An e4m3 byte as the float32 whose exponent and mantissa fields hold its own, 2**-120 of its value
        (subnormals included): sign to bit 31, exponent and mantissa to bits 20-26. Vectorises, unlike a table."""
        if byte != types.uint8:
            return None

        def codegen(context, builder, signature, args):
            word = builder.zext(args[0], ir.IntType(32))
            sign = builder.shl(builder.and_(word, ir.Constant(ir.IntType(32), 0x80)), ir.Constant(ir.IntType(32), 24))
            rest = builder.shl(builder.and_(word, ir.Constant(ir.IntType(32), 0x7F)), ir.Constant(ir.IntType(32), 20))
            return builder.bitcast(builder.or_(sign, rest), ir.FloatType())

        return types.float32(byte), codegen

    def _nibble(high: bool):
        @intrinsic
        def nibble(typingctx, byte):
            """The low (or high) 4 bits of a byte as float32, converted from 32 bits (numba's own `&` and `>>`
            widen a uint8 to 64 bits, whose conversion to float32 costs more)."""
            if byte != types.uint8:
                return None

            def codegen(context, builder, signature, args):
                word = builder.zext(args[0], ir.IntType(32))
                if high:
                    word = builder.lshr(word, ir.Constant(ir.IntType(32), 4))
                else:
                    word = builder.and_(word, ir.Constant(ir.IntType(32), 15))
                return builder.sitofp(word, ir.FloatType())

            return types.float32(byte), codegen

        return nibble

    _low_nibble, _high_nibble = _nibble(False), _nibble(True)

    def _vector_sum(builder, vector, lanes):
        """The sum of a float vector's `lanes` elements, halving it lane by lane."""
        i32 = ir.IntType(32)
        while lanes > 1:
            half = lanes // 2
            low = builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(i32, half), list(range(half))))
            high = builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(i32, half),
                                                                      list(range(half, lanes))))
            vector, lanes = builder.fadd(low, high, flags=_REASSOC), half
        return builder.extract_element(vector, ir.Constant(i32, 0))

    def _zero_points(context, builder, zeros_type, zeros, row):
        """(pointer, step) to zero point (row, g) of a [rows, groups] uint8 array: pointer + g * step. An array of
        no rows (symmetric codes) gives a byte holding INT4_SYMMETRIC_ZERO and step 0, so the loop over groups
        loads without a branch."""
        i8 = ir.IntType(8)
        array = context.make_array(zeros_type)(context, builder, zeros)
        rows, groups = cgutils.unpack_tuple(builder, array.shape, 2)
        symmetric = cgutils.alloca_once_value(builder, ir.Constant(i8, INT4_SYMMETRIC_ZERO))
        has_zeros = builder.icmp_signed(">", rows, ir.Constant(rows.type, 0))
        row_start = builder.gep(array.data, [builder.mul(row, groups)])
        pointer = builder.select(has_zeros, row_start, builder.bitcast(symmetric, row_start.type))
        return pointer, builder.select(has_zeros, ir.Constant(groups.type, 1), ir.Constant(groups.type, 0))

    # Twice each e2m1 code's value (codes 0 .. 15: sign, two exponent bits, one mantissa bit), as int8
    _E2M1_DOUBLED = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
    # The host's byte table lookup of 16 entries (a vector of 16 indices into a vector of 16 bytes) as an LLVM
    # intrinsic, where it has one; LLVM's own IR has no shuffle by a variable index vector.
    _TABLE_LOOKUP = {"x86_64": "llvm.x86.ssse3.pshuf.b.128", "AMD64": "llvm.x86.ssse3.pshuf.b.128",
                     "aarch64": "llvm.aarch64.neon.tbl1.v16i8", "arm64": "llvm.aarch64.neon.tbl1.v16i8"}.get(
        platform.machine())

    def _e2m1_doubled(builder, codes, lookup: str | None = _TABLE_LOOKUP):
        """A vector of 16 e2m1 codes (i8 lanes, 0 .. 15) as float32 lanes of twice their values, integers in
        [-12, 12]: one table lookup of the bytes by the intrinsic `lookup` (the host's, _TABLE_LOOKUP), else from
        the code's bits (m for exponent 0, else (2 + m) << (exponent - 1), negated where the sign bit is set)."""
        byte_vector = codes.type
        floats = ir.VectorType(ir.FloatType(), byte_vector.count)
        if lookup is not None and byte_vector.count == 16:
            table = ir.Constant(byte_vector, _E2M1_DOUBLED)
            function = builder.module.declare_intrinsic(lookup, fnty=ir.FunctionType(byte_vector, [byte_vector] * 2))
            return builder.sitofp(builder.call(function, [table, codes]), floats)

        def splat(value):
            return ir.Constant(byte_vector, [value] * byte_vector.count)

        exponent = builder.and_(builder.lshr(codes, splat(1)), splat(3))
        mantissa = builder.and_(codes, splat(1))
        normal = builder.shl(builder.or_(mantissa, splat(2)), builder.sub(exponent, splat(1)))
        magnitude = builder.select(builder.icmp_unsigned("==", exponent, splat(0)), mantissa, normal)
        negative = builder.icmp_unsigned("!=", builder.and_(codes, splat(8)), splat(0))
        value = builder.select(negative, builder.sub(splat(0), magnitude), magnitude)
        return builder.sitofp(value, floats)

    def _e8m0_half_scale(builder, byte):
        """An e8m0 exponent byte E as the float32 2**(E - 128): the scale of doubled e2m1 values (subnormal below
        E = 2)."""
        i32 = ir.IntType(32)
        word = builder.zext(byte, i32)
        normal = builder.shl(builder.sub(word, ir.Constant(i32, 1)), ir.Constant(i32, 23))
        subnormal = builder.lshr(ir.Constant(i32, 0x00400000), builder.sub(ir.Constant(i32, 1), word))
        bits = builder.select(builder.icmp_unsigned(">=", word, ir.Constant(i32, 2)), normal, subnormal)
        return builder.bitcast(bits, ir.FloatType())

    def _splat(builder, value, vector_type):
        """A scalar in every lane of a vector of `vector_type`."""
        lanes = vector_type.count
        first = builder.insert_element(ir.Constant(vector_type, [0.0] * lanes), value, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(first, first, ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))

    def _pair_groups(mxfp4: bool):
        """The vector code of `_code_dots` for int4 codes, or for mxfp4's (`mxfp4`)."""

        @intrinsic
        def pair_groups(typingctx, row_a, row_b, scales_a, scales_b, zeros_a, index_a, zeros_b, index_b,
                        group_sums, x_even, x_odd, first_group, groups, group_bytes, x_byte, sums_group):
            """For rows a and b (uint8 arrays of 4-bit codes, each byte an even column in its low nibble and the
            next in its high one): the sum over groups g = first_group .. first_group + groups - 1 of scale(g) * (the
            sum over the group's bytes j (row bytes g * group_bytes ..) of value(low(j)) * x_even[j - x_byte] +
            value(high(j)) * x_odd[j - x_byte], less the zero point times group_sums[g - sums_group]). int4: a code's
            value is the code, zero points row index_a of zeros_a ([rows, groups] uint8; no rows:
            INT4_SYMMETRIC_ZERO), scales of any dtype read as float32 (the kernel is compiled for every format's
            scales, though only int4's reach this code); mxfp4: twice the code's e2m1 value, no zero point, and the
            scale byte E as 2**(E - 128). Written as vector code of VECTOR_BYTES bytes a step so that each row's
            sum stays in one vector of float32 lanes across its groups (a group's sum is scaled lane by lane, and
            the lanes are added once at the end), where LLVM's own vectorisation of the loop adds the lanes at the
            end of every group. group_bytes: a multiple of VECTOR_BYTES. The arrays are C-contiguous; rows, scales,
            sums and x one-dimensional."""
            vectors = (row_a, row_b, scales_a, scales_b, group_sums, x_even, x_odd)
            expected = (types.uint8, types.uint8, None, None, types.float32, types.float32, types.float32)
            if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == (d or a.dtype)
                       for a, d in zip(vectors, expected)):
                return None
            if not all(isinstance(z, types.Array) and z.ndim == 2 and z.layout == "C" and z.dtype == types.uint8
                       for z in (zeros_a, zeros_b)):
                return None
            signature = types.UniTuple(types.float32, 2)(
                row_a, row_b, scales_a, scales_b, zeros_a, types.int64, zeros_b, types.int64, group_sums, x_even,
                x_odd, types.int64, types.int64, types.int64, types.int64, types.int64)

            def codegen(context, builder, sig, args):
                i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
                lanes = VECTOR_BYTES
                byte_vector, float_vector = ir.VectorType(ir.IntType(8), lanes), ir.VectorType(f32, lanes)

                def data(k):
                    return context.make_array(sig.args[k])(context, builder, args[k]).data

                code_a, code_b, scale_a, scale_b, sums, even, odd = (data(k) for k in (0, 1, 2, 3, 8, 9, 10))
                first, count, step_bytes, x_first, sums_first = args[11:16]
                zeros = ir.Constant(float_vector, [0.0] * lanes)
                low_mask, four = ir.Constant(byte_vector, [15] * lanes), ir.Constant(byte_vector, [4] * lanes)
                totals = [cgutils.alloca_once_value(builder, zeros) for _ in range(2)]
                steps = builder.udiv(step_bytes, ir.Constant(i64, lanes))
                zero_points = [_zero_points(context, builder, sig.args[k], args[k], args[k + 1]) for k in (4, 6)]

                def load(pointer, offset, vector_type, align):
                    return builder.load(builder.bitcast(builder.gep(pointer, [offset]), vector_type.as_pointer()),
                                        align=align)

                def values(nibbles):
                    return _e2m1_doubled(builder, nibbles) if mxfp4 else builder.uitofp(nibbles, float_vector)

                with cgutils.for_range(builder, count) as group_loop:
                    group = builder.add(first, group_loop.index)
                    sums_v = [cgutils.alloca_once_value(builder, zeros) for _ in range(2)]
                    start = builder.mul(group, step_bytes)
                    with cgutils.for_range(builder, steps) as step_loop:
                        byte = builder.add(start, builder.mul(step_loop.index, ir.Constant(i64, lanes)))
                        x_at = builder.sub(byte, x_first)
                        x_low, x_high = load(even, x_at, float_vector, 4), load(odd, x_at, float_vector, 4)
                        for codes, total in zip((code_a, code_b), sums_v):
                            packed = load(codes, byte, byte_vector, 1)
                            low = values(builder.and_(packed, low_mask))
                            high = values(builder.lshr(packed, four))
                            value = builder.fadd(builder.load(total), builder.fmul(low, x_low, flags=_REASSOC),
                                                 flags=_REASSOC)
                            value = builder.fadd(value, builder.fmul(high, x_high, flags=_REASSOC), flags=_REASSOC)
                            builder.store(value, total)
                    # int4: the zero point's share, z * the token's group sum, off lane 0 of the group's vector
                    group_sum = builder.load(builder.gep(sums, [builder.sub(group, sums_first)]))
                    for scales, scales_type, total, codes_sum, (zero_at, zero_step) in zip(
                            (scale_a, scale_b), sig.args[2:4], totals, sums_v, zero_points):
                        stored = builder.load(builder.gep(scales, [group]))
                        if mxfp4:  # (a kernel of float32 scales compiles this branch too, but never runs it)
                            exponent = context.cast(builder, stored, scales_type.dtype, types.uint8)
                            scale, shifted = _e8m0_half_scale(builder, exponent), builder.load(codes_sum)
                        else:
                            zero = builder.uitofp(builder.load(builder.gep(zero_at, [builder.mul(group, zero_step)])),
                                                  f32)
                            shift = builder.insert_element(zeros, builder.fmul(zero, group_sum), ir.Constant(i32, 0))
                            scale = context.cast(builder, stored, scales_type.dtype, types.float32)
                            shifted = builder.fsub(builder.load(codes_sum), shift, flags=_REASSOC)
                        scaled = builder.fmul(shifted, _splat(builder, scale, float_vector), flags=_REASSOC)
                        builder.store(builder.fadd(builder.load(total), scaled, flags=_REASSOC), total)
                results = [_vector_sum(builder, builder.load(total), lanes) for total in totals]
                return context.make_tuple(builder, sig.return_type, results)

            return signature, codegen

        return pair_groups

    _int4_pair_groups, _mxfp4_pair_groups = _pair_groups(False), _pair_groups(True)

    @intrinsic
    def _mxfp4_decode_blocks(typingctx, row, scales, first_block, blocks, low, high):
        """mxfp4 blocks b = first_block .. first_block + blocks - 1 of a row (uint8 codes, 16 bytes a block, each
        byte an even column in its low nibble and the next in its high one; scales: the row's e8m0 exponent bytes,
        read as uint8 whatever their dtype, since a kernel compiled for other formats' scales compiles this call
        too) as float32 values: the low nibbles of the block's bytes to low[16 (b - first_block) ..], the high ones
        to high[...], in vector code (a table lookup of 16 codes at once, `_e2m1_doubled`). The arrays are
        C-contiguous and one-dimensional."""
        if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in (row, scales, low, high)):
            return None
        if row.dtype != types.uint8 or low.dtype != types.float32 or high.dtype != types.float32:
            return None
        signature = types.void(row, scales, types.int64, types.int64, low, high)

        def codegen(context, builder, sig, args):
            i64 = ir.IntType(64)
            byte_vector = ir.VectorType(ir.IntType(8), VECTOR_BYTES)
            float_vector = ir.VectorType(ir.FloatType(), VECTOR_BYTES)
            codes, exponents, low_out, high_out = (context.make_array(sig.args[k])(context, builder, args[k]).data
                                                   for k in (0, 1, 4, 5))
            first, count = args[2], args[3]
            low_mask, four = ir.Constant(byte_vector, [15] * VECTOR_BYTES), ir.Constant(byte_vector, [4] * VECTOR_BYTES)
            with cgutils.for_range(builder, count) as loop:
                block = builder.add(first, loop.index)
                at = builder.mul(block, ir.Constant(i64, VECTOR_BYTES))
                out_at = builder.mul(loop.index, ir.Constant(i64, VECTOR_BYTES))
                packed = builder.load(builder.bitcast(builder.gep(codes, [at]), byte_vector.as_pointer()), align=1)
                exponent = context.cast(builder, builder.load(builder.gep(exponents, [block])), sig.args[1].dtype,
                                        types.uint8)
                scale = _splat(builder, _e8m0_half_scale(builder, exponent), float_vector)
                for nibbles, out in ((builder.and_(packed, low_mask), low_out), (builder.lshr(packed, four), high_out)):
                    values = builder.fmul(_e2m1_doubled(builder, nibbles), scale)
                    builder.store(values, builder.bitcast(builder.gep(out, [out_at]), float_vector.as_pointer()),
                                  align=4)
            return context.get_dummy_value()

        return signature, codegen

FP8_BIAS = np.float32(2.0**120)  # 2**(127 - 7): float32's exponent bias less e4m3's


# Inner loops run over np.uint64 indices: with a signed index numba checks for negative (wrap-around) indices,
# which stops LLVM vectorising the loop (as in cpu_executor's kernel).
@jit(inline="always")
def _e8m0(byte):
    """An mxfp4 exponent byte as its scale 2**(byte - 127), exact in float32 (2**-127 a subnormal); the NaN byte
    never reaches a kernel."""
    return np.float32(math.ldexp(1.0, int(byte) - E8M0_BIAS))


@jit(inline="always", fastmath=FASTMATH)
def _decode_row(kind, w, scale, zero, rows_per_scale, cols_per_scale, o, c0, c1, buf):
    """Weight row o over columns c0 .. c1 - 1 as float32 in buf, laid out as `_paired` lays out the tokens:
    fp8: buf[c - c0]; int4 and mxfp4: the bytes j0 = c0 // 2 .. ceil(c1 / 2) - 1, low nibbles (even columns) in
    buf[j - j0], high nibbles (odd columns) in buf[nb + j - j0] (nb bytes): two contiguous stores per byte."""
    scale_row = o // rows_per_scale
    row = w[o]  # [bytes per row] uint8
    if kind == MXFP4:
        j0, j1 = c0 >> 1, (c1 + 1) >> 1
        nb, per_block = j1 - j0, cols_per_scale >> 1
        whole_first, whole_end = (j0 + per_block - 1) // per_block, j1 // per_block  # blocks inside j0 .. j1 - 1
        vector = numba is not None and per_block == VECTOR_BYTES and whole_end > whole_first
        if vector:
            at = whole_first * per_block - j0
            _mxfp4_decode_blocks(row, scale[scale_row], whole_first, whole_end - whole_first, buf[at:nb],
                                 buf[nb + at:])
        for block in range(j0 // per_block, (j1 - 1) // per_block + 1):
            if vector and whole_first <= block < whole_end:
                continue
            a, b = max(j0, block * per_block), min(j1, (block + 1) * per_block)
            s = _e8m0(scale[scale_row, block])
            values, low, high = row[a:b], buf[a - j0:], buf[nb + a - j0:]
            for j in range(np.uint64(0), np.uint64(b - a)):
                byte = values[j]
                low[j] = E2M1[byte & 15] * s
                high[j] = E2M1[byte >> 4] * s
        return
    if kind == INT4:
        j0, j1 = c0 >> 1, (c1 + 1) >> 1
        nb, per_group = j1 - j0, cols_per_scale >> 1  # bytes decoded, bytes per group
        for group in range(j0 // per_group, (j1 - 1) // per_group + 1):
            a, b = max(j0, group * per_group), min(j1, (group + 1) * per_group)
            s = scale[scale_row, group]
            z = np.float32(zero[o, group]) if zero.shape[0] else np.float32(INT4_SYMMETRIC_ZERO)
            values, low, high = row[a:b], buf[a - j0:], buf[nb + a - j0:]
            for j in range(np.uint64(0), np.uint64(b - a)):
                byte = values[j]
                low[j] = (_low_nibble(byte) - z) * s
                high[j] = (_high_nibble(byte) - z) * s
        return
    for group in range(c0 // cols_per_scale, (c1 - 1) // cols_per_scale + 1):
        a, b = max(c0, group * cols_per_scale), min(c1, (group + 1) * cols_per_scale)
        s = scale[scale_row, group] * FP8_BIAS
        values, out = row[a:b], buf[a - c0:]
        for c in range(np.uint64(0), np.uint64(b - a)):
            out[c] = _fp8_bits(values[c]) * s


@jit(inline="always")
def _paired(kind, x, c0, c1):
    """The tokens x [n, c1 - c0] (column 0 is column c0 of the weights) in the layout `_decode_row` gives the
    weights: fp8: x itself; int4 and mxfp4: [n, 2 nb], the even columns of bytes c0 // 2 .. then the odd ones,
    zero where a byte's nibble lies outside c0 .. c1 - 1."""
    if kind == FP8_CODES:
        return x
    j0, j1 = c0 >> 1, (c1 + 1) >> 1
    nb = j1 - j0
    out = np.zeros((x.shape[0], 2 * nb), np.float32)
    for t in range(x.shape[0]):
        for j in range(nb):
            even = 2 * (j0 + j) - c0
            if 0 <= even < c1 - c0:
                out[t, j] = x[t, even]
            if 0 <= even + 1 < c1 - c0:
                out[t, nb + j] = x[t, even + 1]
    return out


@jit(inline="always", fastmath=FASTMATH)
def _dot(buf, x, t, width):
    """buf · x[t] over `width` columns."""
    acc = np.float32(0.0)
    row = x[t]
    for c in range(np.uint64(0), np.uint64(width)):
        acc += buf[c] * row[c]
    return acc


@jit(inline="always", fastmath=FASTMATH)
def _dot4(buf, x, t, width):
    """buf · x[t + k] for k < 4: the decoded row read once for four tokens."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    r0, r1, r2, r3 = x[t], x[t + 1], x[t + 2], x[t + 3]
    for c in range(np.uint64(0), np.uint64(width)):
        v = buf[c]
        a0 += v * r0[c]
        a1 += v * r1[c]
        a2 += v * r2[c]
        a3 += v * r3[c]
    return a0, a1, a2, a3


@jit(inline="always", fastmath=FASTMATH)
def _dots(buf, x, width, out, column):
    """out[t, column] = buf · x[t] for every token t, four at a time."""
    n = x.shape[0]
    t = 0
    while t + 4 <= n:
        out[t, column], out[t + 1, column], out[t + 2, column], out[t + 3, column] = _dot4(buf, x, t, width)
        t += 4
    while t < n:
        out[t, column] = _dot(buf, x, t, width)
        t += 1


@jit(inline="always")
def _group_sums(xs, c0, c1, cols_per_scale):
    """For int4's rows times few tokens: sums [n, groups] over each group of columns c0 .. c1 - 1 of the paired
    tokens xs (groups of cols_per_scale columns counted from column 0; entry g - c0 // cols_per_scale for group
    g)."""
    j0, j1 = c0 >> 1, (c1 + 1) >> 1
    nb, per_group = j1 - j0, cols_per_scale >> 1
    first = j0 // per_group
    sums = np.zeros((xs.shape[0], (j1 - 1) // per_group + 1 - first), np.float32)
    for t in range(xs.shape[0]):
        row = xs[t]
        for group in range(first, (j1 - 1) // per_group + 1):
            a, b = max(j0, group * per_group), min(j1, (group + 1) * per_group)
            acc = np.float32(0.0)
            for j in range(np.uint64(a - j0), np.uint64(b - j0)):
                acc += row[j] + row[nb + j]
            sums[t, group - first] = acc
    return sums


@jit(inline="always", fastmath=FASTMATH)
def _code_dots(kind, wa, sa, za, oa, wb, sb, zb, ob, c0, c1, cols_per_scale, xs, t, sums):
    """Weight row oa of wa and row ob of wb (int4 or mxfp4 codes, `kind`, over columns c0 .. c1 - 1, groups of
    cols_per_scale columns in both) times the paired token xs[t], without decoding the rows: per group, scale *
    (sum of code values times the token - int4's zero point * the token's group sum, sums[t]). Both rows in one
    pass, so each element of the token is loaded once for two rows. The groups that lie whole in the range take the
    vector code (_int4_pair_groups, _mxfp4_pair_groups) where their bytes are whole vector steps; the others, a
    scalar loop."""
    j0, j1 = c0 >> 1, (c1 + 1) >> 1
    nb, per_group = j1 - j0, cols_per_scale >> 1
    first = j0 // per_group
    whole_first, whole_end = (j0 + per_group - 1) // per_group, j1 // per_group  # groups inside j0 .. j1 - 1
    vector = numba is not None and per_group % VECTOR_BYTES == 0 and whole_end > whole_first
    row_a, row_b, x = wa[oa], wb[ob], xs[t]
    total_a, total_b = np.float32(0.0), np.float32(0.0)
    if vector:
        if kind == MXFP4:
            total_a, total_b = _mxfp4_pair_groups(row_a, row_b, sa[oa], sb[ob], za, oa, zb, ob, sums[t], x[:nb],
                                                  x[nb:], whole_first, whole_end - whole_first, per_group, j0, first)
        else:
            total_a, total_b = _int4_pair_groups(row_a, row_b, sa[oa], sb[ob], za, oa, zb, ob, sums[t], x[:nb],
                                                 x[nb:], whole_first, whole_end - whole_first, per_group, j0, first)
    for group in range(first, (j1 - 1) // per_group + 1):
        if vector and whole_first <= group < whole_end:  # in the totals already
            continue
        a, b = max(j0, group * per_group), min(j1, (group + 1) * per_group)
        values_a, values_b, low, high = row_a[a:b], row_b[a:b], x[a - j0:], x[nb + a - j0:]
        acc_a, acc_b = np.float32(0.0), np.float32(0.0)
        if kind == MXFP4:
            for j in range(np.uint64(0), np.uint64(b - a)):
                byte_a, byte_b = values_a[j], values_b[j]
                acc_a += E2M1[byte_a & 15] * low[j] + E2M1[byte_a >> 4] * high[j]
                acc_b += E2M1[byte_b & 15] * low[j] + E2M1[byte_b >> 4] * high[j]
            total_a += _e8m0(sa[oa, group]) * acc_a
            total_b += _e8m0(sb[ob, group]) * acc_b
            continue
        for j in range(np.uint64(0), np.uint64(b - a)):
            x_low, x_high = low[j], high[j]
            byte_a, byte_b = values_a[j], values_b[j]
            acc_a += _low_nibble(byte_a) * x_low + _high_nibble(byte_a) * x_high
            acc_b += _low_nibble(byte_b) * x_low + _high_nibble(byte_b) * x_high
        symmetric = np.float32(INT4_SYMMETRIC_ZERO)
        z_a = np.float32(za[oa, group]) if za.shape[0] else symmetric
        z_b = np.float32(zb[ob, group]) if zb.shape[0] else symmetric
        group_sum = sums[t, group - first]
        total_a += sa[oa, group] * (acc_a - z_a * group_sum)
        total_b += sb[ob, group] * (acc_b - z_b * group_sum)
    return total_a, total_b


@jit(parallel=True, fastmath=FASTMATH, nogil=True)
def grouped_expert_kernel(kind, gate, gate_scale, gate_zero, gate_rows, gate_cols, up, up_scale, up_zero, up_rows,
                          up_cols, down, down_scale, down_zero, down_rows, down_cols, gate_bias, up_bias, activation, x,
                          first, last, h, y, threads):
    """The expert's part over intermediate rows first .. last - 1 (all of it: 0 .. I) on `threads` threads, without
    the down projection's bias. gate_bias, up_bias [I] float32 or [0]; activation: jit.SILU or another (limit,
    alpha, up_shift); x [n, H] float32 in; h [n, last - first] float32 scratch; y [n, H] float32 out."""
    n, width = x.shape
    hidden = y.shape[1]
    rows = last - first
    xs = _paired(kind, x, 0, width)  # [n, H], or int4's and mxfp4's [n, 2 ceil(H / 2)]
    direct = DIRECT_INT4_TOKENS if kind == INT4 else DIRECT_MXFP4_TOKENS if kind == MXFP4 else 0
    if n < direct:  # decode-sized: rows times the tokens straight from their codes
        _few_tokens(kind, gate, gate_scale, gate_zero, gate_cols, up, up_scale, up_zero, up_cols, down, down_scale,
                    down_zero, down_cols, gate_bias, up_bias, activation, xs, width, first, last, h, y, threads)
        return
    chunks = max(1, min(rows, threads * CHUNKS_PER_THREAD))
    for chunk in numba.prange(chunks):
        g = np.empty(xs.shape[1], np.float32)  # one decoded gate row
        u = np.empty(xs.shape[1], np.float32)  # and up row
        gx = np.empty((n, 1), np.float32)  # its products with the tokens [n, 1]
        ux = np.empty((n, 1), np.float32)
        for o in range(first + chunk * rows // chunks, first + (chunk + 1) * rows // chunks):
            _decode_row(kind, gate, gate_scale, gate_zero, gate_rows, gate_cols, o, 0, width, g)
            _decode_row(kind, up, up_scale, up_zero, up_rows, up_cols, o, 0, width, u)
            _dots(g, xs, xs.shape[1], gx, 0)
            _dots(u, xs, xs.shape[1], ux, 0)
            gb = gate_bias[o] if gate_bias.shape[0] else np.float32(0.0)
            ub = up_bias[o] if up_bias.shape[0] else np.float32(0.0)
            for t in range(n):
                h[t, o - first] = gated(gx[t, 0] + gb, ux[t, 0] + ub, activation)
    hs = _paired(kind, h, first, last)  # [n, last - first], or int4's and mxfp4's pairs
    chunks = max(1, min(hidden, threads * CHUNKS_PER_THREAD))
    for chunk in numba.prange(chunks):
        d = np.empty(hs.shape[1], np.float32)  # one decoded down row's columns first .. last - 1
        for o in range(chunk * hidden // chunks, (chunk + 1) * hidden // chunks):
            _decode_row(kind, down, down_scale, down_zero, down_rows, down_cols, o, first, last, d)
            _dots(d, hs, hs.shape[1], y, o)


@jit(inline="always", fastmath=FASTMATH)
def _few_tokens(kind, gate, gate_scale, gate_zero, gate_cols, up, up_scale, up_zero, up_cols, down, down_scale,
                down_zero, down_cols, gate_bias, up_bias, activation, xs, width, first, last, h, y, threads):
    """grouped_expert_kernel for int4 or mxfp4 experts (`kind`) and fewer than DIRECT_*_TOKENS paired tokens xs
    [n, 2 ceil(H / 2)] (H = width): each row times each token straight from its codes (_code_dots), the row's
    bytes in L1 after the first token."""
    n = xs.shape[0]
    hidden = y.shape[1]
    rows = last - first
    gate_sums = _group_sums(xs, 0, width, gate_cols)
    up_sums = gate_sums if up_cols == gate_cols else _group_sums(xs, 0, width, up_cols)
    chunks = max(1, min(rows, threads * CHUNKS_PER_THREAD))
    for chunk in numba.prange(chunks):
        for o in range(first + chunk * rows // chunks, first + (chunk + 1) * rows // chunks):
            for t in range(n):
                if up_cols == gate_cols:  # gate and up rows o in one pass over the token
                    gv, uv = _code_dots(kind, gate, gate_scale, gate_zero, o, up, up_scale, up_zero, o, 0, width,
                                        gate_cols, xs, t, gate_sums)
                else:
                    gv = _code_dots(kind, gate, gate_scale, gate_zero, o, gate, gate_scale, gate_zero, o, 0, width,
                                    gate_cols, xs, t, gate_sums)[0]
                    uv = _code_dots(kind, up, up_scale, up_zero, o, up, up_scale, up_zero, o, 0, width, up_cols, xs,
                                    t, up_sums)[0]
                gb = gate_bias[o] if gate_bias.shape[0] else np.float32(0.0)
                ub = up_bias[o] if up_bias.shape[0] else np.float32(0.0)
                h[t, o - first] = gated(gv + gb, uv + ub, activation)
    hs = _paired(kind, h, first, last)  # [n, 2 ceil(...)]: the intermediate rows in pairs of columns
    down_sums = _group_sums(hs, first, last, down_cols)
    pairs = (hidden + 1) // 2  # down rows two at a time (the last one with itself when hidden is odd)
    chunks = max(1, min(pairs, threads * CHUNKS_PER_THREAD))
    for chunk in numba.prange(chunks):
        for p in range(chunk * pairs // chunks, (chunk + 1) * pairs // chunks):
            o = 2 * p
            o2 = min(o + 1, hidden - 1)
            for t in range(n):
                y[t, o], y[t, o2] = _code_dots(kind, down, down_scale, down_zero, o, down, down_scale, down_zero, o2,
                                               first, last, down_cols, hs, t, down_sums)
