// Launch contract
//
// Multi-head Latent Attention (DeepSeek-V3, Kimi K2) with the up-projections absorbed: each head's query is taken
// onto the latent (linear.cu's per_head_rows) and attends, with its rotated rope part, over cached rows
// [latent (R) | rotated rope key (ROPE)] that serve as keys and, their first R values, as values; one cache array
// [num_blocks, block_size, 1, R + ROPE] per layer. Prefill chunks of DeepSeek-V3's widths at matmul precision
// medium take the decompressed form instead (latent_prefill.cu).
//
// latent_rope_write<KV>: the step from the projections to attention.
//   q float32 [T, Q, N + ROPE] contiguous (each head's query: N values without rotary, then its rope part); latent
//   float32 [T, R] (normalised); k_rope float32 [T, ROPE]; cos, sin float32 [P, ROPE / 2]; positions, slot_mapping
//   int64 [T]; query float32 [T, Q, N + ROPE] (out); cache KV [num_blocks * block_size, R + ROPE].
//   query[t, h] = [q[t, h, :N] | rotate(q[t, h, N:])]; cache row slot_mapping[t] (negative: none) =
//   [latent[t] | rotate(k_rope[t])] / scale, rounded to KV. rotate: the rotate-half form out[i] = x1 c - x2 s,
//   out[i + ROPE / 2] = x2 c + x1 s with (x1, x2) = (x[i], x[i + ROPE / 2]), or (x[2i], x[2i + 1]) when
//   `interleaved`, c and s at the token's position (model/rope.py's tables, backends/rotary.py's NumPy form).
//   grid: (T, ceil(Q / ROPE_HEADS)), block: 256 threads; block (t, 0) also writes the cache row.
//
// latent_attention<KV, R, ROPE, SPLIT, MT>: every query token over its own causal range of the latent cache (decode
// tokens and prefill chunks alike: token t of the sequence query_start names, at position p, reads keys 0 .. p) on
// tensor cores, flash-decoding style (mma.sync.m16n8k16, float32 accumulation).
//   q_latent float32 [T, Q, R] contiguous (each head's query taken onto the latent); q_rope float32: the rotated rope
//   part of head h of token t at q_rope + (t Q + h) rope_stride (latent_rope_write's query, past its N no-rope
//   values); cache KV [num_blocks, block_size, 1, R + ROPE]
//   (__nv_bfloat16 or __half used as stored, exactly; __nv_fp8_e4m3 copied as bytes and widened to __half, exactly),
//   block_tables int64 [B, max_blocks], query_start int64 [B + 1], positions int64 [T];
//   out float32 [T, Q, R] (the attention output over the values, the latent part of the rows), or, where the
//   token's S_t > 1 splits, the unnormalised partials partial_acc [T, Q, S, R] / partial_ml [T, Q, S, 2] (m in
//   natural-log units) that attention.cu's paged_attention_merge combines (head_dim R, window 0). The splits are
//   attention.cu's: split z of S_t = decode_splits(p + 1, split_keys, S) takes keys [lo, hi) of the token's p + 1.
//   Scores are scaled by `scale` (k_scale folded in), outputs multiplied by v_scale.
//   grid: (T, ceil(Q / (MT * LATENT_HEADS)), S), block: MT * LATENT_THREADS, dynamic shared memory
//   latent_shared_bytes: the key tiles (LATENT_STAGES of them; fp8: one, and LATENT_STAGES tiles of raw bytes).
// Block (t, y, z) takes query heads 16 MT y .. 16 MT (y + 1) - 1 of token t (MT m-tiles of 16; heads past Q are
// zero queries, never written) over its split's keys in tiles of LATENT_KEYS, each tile copied once with cp.async
// for the whole block while the one before it is used: MT = 2 reads each tile once for 32 heads, what a prefill
// chunk's many blocks per token want; MT = 1 leaves more blocks to split a decode token's context over. Each m-tile
// has LATENT_WARPS warps: warp w of one computes the scores' partial products over a quarter of the R + ROPE
// dimensions, the m-tile's warps add their partials in shared memory in one fixed order (so each of them holds
// the same scores), each runs the same online softmax, and warp w accumulates the output dims
// [w R / 4, (w + 1) R / 4) from the tile's rows.
// Numerics: SPLIT (matmul precision high), as flash_decode's: q and the probabilities split into two parts of the
// operand type (about 16 significant bits), within about 1e-5 of float32 attention; without SPLIT (medium) one part
// each, as flash_attention's bf16 operands (about 1e-3).
#include "flash.cuh"

constexpr int ROPE_HEADS = 2;  // query heads per block of latent_rope_write
constexpr int LATENT_WARPS = 4;
constexpr int LATENT_THREADS = LATENT_WARPS * 32;
constexpr int LATENT_HEADS = 16;  // query heads per block: one m-tile
constexpr int LATENT_KEYS = 32;   // keys per tile
constexpr int LATENT_STAGES = 2;  // tiles in shared memory: the one in use and the next one streaming in

// The rotate-half form of element i of a rope part x [rope] at cos / sin row c, s (rope / 2 each).
__device__ __forceinline__ float rotated(const float* x, const float* c, const float* s, int i, int rope,
                                         bool interleaved) {
    const int half = rope / 2, k = i < half ? i : i - half;
    const float x1 = interleaved ? x[2 * k] : x[k], x2 = interleaved ? x[2 * k + 1] : x[k + half];
    return i < half ? x1 * c[k] - x2 * s[k] : x2 * c[k] + x1 * s[k];
}

template <typename KV>
__global__ void __launch_bounds__(256)
latent_rope_write(const float* __restrict__ q, const float* __restrict__ latent, const float* __restrict__ k_rope,
                  const float* __restrict__ cos, const float* __restrict__ sin, const long long* __restrict__ positions,
                  const long long* __restrict__ slot_mapping, float* __restrict__ query, KV* __restrict__ cache,
                  int num_heads, int N, int R, int rope, int interleaved, float scale) {
    pdl_wait();
    const long long t = blockIdx.x;
    const int half = rope / 2, query_width = N + rope, width = R + rope;
    const float* c = cos + positions[t] * half;
    const float* s = sin + positions[t] * half;
    const int head0 = blockIdx.y * ROPE_HEADS, heads = min(ROPE_HEADS, num_heads - head0);
    for (int e = threadIdx.x; e < heads * query_width; e += blockDim.x) {
        const int h = head0 + e / query_width, d = e % query_width;
        const long long row = t * num_heads + h;
        const float* q_row = q + row * query_width;
        query[row * query_width + d] = d < N ? q_row[d] : rotated(q_row + N, c, s, d - N, rope, interleaved != 0);
    }
    const long long slot = slot_mapping[t];
    if (blockIdx.y != 0 || slot < 0) return;
    for (int d = threadIdx.x; d < width; d += blockDim.x) {
        const float v = d < R ? latent[t * R + d] : rotated(k_rope + t * rope, c, s, d - R, rope, interleaved != 0);
        cache[slot * width + d] = from_float<KV>(v / scale);
    }
}

template <typename KV, int R, int ROPE, bool SPLIT, int MT>
__global__ void __launch_bounds__(LATENT_THREADS * MT, MT == 1 ? 2 : 1)
latent_attention(const float* __restrict__ q_latent, const float* __restrict__ q_rope, int rope_stride,
                 const KV* __restrict__ cache, const long long* __restrict__ block_tables,
                 const long long* __restrict__ query_start, const long long* __restrict__ positions,
                 float* __restrict__ out, float* __restrict__ partial_acc, float* __restrict__ partial_ml,
                 int num_seqs, int num_heads, int block_size, int max_blocks, float scale, float v_scale,
                 int split_keys) {
    constexpr int DK = R + ROPE;                       // elements of a cached row
    constexpr int STRIDE = DK + FLASH_PAD;             // elements per shared row
    constexpr int KSTEPS = DK / 16 / LATENT_WARPS;     // k-steps of a warp's partial scores
    constexpr int WARP_DIMS = R / LATENT_WARPS;        // output dims of a warp
    constexpr int DTILES = WARP_DIMS / 8;              // n-tiles of a warp's output
    constexpr int NTILES = LATENT_KEYS / 8;            // n-tiles of the scores
    constexpr int TILE = LATENT_KEYS * STRIDE;         // elements of a tile in shared memory
    constexpr bool WIDEN = sizeof(KV) == 1;            // fp8: copied as bytes, widened before use
    constexpr int ELEMENTS = 16 / sizeof(KV);          // cache elements per 16-byte copy
    constexpr int ROW_COPIES = DK / ELEMENTS;          // 16-byte copies per cached row
    constexpr int THREADS = LATENT_THREADS * MT;       // MT groups of LATENT_WARPS warps, an m-tile each
    constexpr int TILE_COPIES = LATENT_KEYS * ROW_COPIES;  // 16-byte copies of a tile
    constexpr int RAW_TILE = LATENT_KEYS * DK;         // bytes of an fp8 tile as copied
    static_assert(DK % (16 * LATENT_WARPS) == 0 && R % (16 * LATENT_WARPS) == 0, "warps take whole k-steps");
    static_assert(NTILES % 2 == 0, "the keys' fragments come two n-tiles at a time");
    using Op = typename DecodeOperand<KV>::type;
    using M = Mma<Op>;
    // [WIDEN ? 1 : LATENT_STAGES][TILE] tiles (the bits of Op elements), then with WIDEN [LATENT_STAGES][RAW_TILE]
    // bytes as copied
    extern __shared__ __align__(16) unsigned char latent_shared[];
    __nv_bfloat16* const tiles_s = reinterpret_cast<__nv_bfloat16*>(latent_shared);
    unsigned char* const raw_s = latent_shared + (WIDEN ? 1 : LATENT_STAGES) * TILE * 2;
    __shared__ float partial_s[LATENT_WARPS * MT][NTILES][4][32];  // each warp's partial scores, by fragment position
    pdl_wait();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, c = lane % 4;
    const int group = warp / LATENT_WARPS, quarter = warp % LATENT_WARPS;  // this warp's m-tile, its share of it
    const int t = blockIdx.x, head0 = (blockIdx.y * MT + group) * LATENT_HEADS, split = blockIdx.z;
    const DecodeSplit range = decode_split(static_cast<int>(positions[t]), 0, split_keys, split, gridDim.z);
    if (split >= range.splits) return;  // the token's splits are fewer than the launch's: this block is idle
    const int lo = range.lo, hi = range.hi;  // this split's keys [lo, hi)
    const long long* table = decode_table(t, num_seqs, query_start, block_tables, max_blocks);

    // Rows r and r + 8 of the m-tile (heads head0 + r, head0 + r + 8; zero past Q), this warp's dims, as A fragments
    // of high and low parts.
    const int k_dim0 = quarter * KSTEPS * 16;
    unsigned qa[KSTEPS][4], ql[SPLIT ? KSTEPS : 1][4];
    {
        const bool in_a = head0 + r < num_heads, in_b = head0 + r + 8 < num_heads;
        const long long head_row = static_cast<long long>(t) * num_heads;
        const long long head_a = head_row + min(head0 + r, num_heads - 1);
        const long long head_b = head_row + min(head0 + r + 8, num_heads - 1);
        const float2 zero = make_float2(0.f, 0.f);
#pragma unroll
        for (int k = 0; k < KSTEPS; ++k) {
            // a k-step lies wholly in the latent part or the rope part (R is a multiple of 16)
            const int dim = k_dim0 + k * 16, d = (dim < R ? dim : dim - R) + 2 * c;
            const float* row_a = dim < R ? q_latent + head_a * R : q_rope + head_a * rope_stride;
            const float* row_b = dim < R ? q_latent + head_b * R : q_rope + head_b * rope_stride;
            const float2 a0 = in_a ? *reinterpret_cast<const float2*>(row_a + d) : zero;
            const float2 a2 = in_a ? *reinterpret_cast<const float2*>(row_a + d + 8) : zero;
            const float2 b0 = in_b ? *reinterpret_cast<const float2*>(row_b + d) : zero;
            const float2 b2 = in_b ? *reinterpret_cast<const float2*>(row_b + d + 8) : zero;
            unsigned lo[4];
            split_pair_as<Op>(a0.x, a0.y, qa[k][0], lo[0]);
            split_pair_as<Op>(b0.x, b0.y, qa[k][1], lo[1]);
            split_pair_as<Op>(a2.x, a2.y, qa[k][2], lo[2]);
            split_pair_as<Op>(b2.x, b2.y, qa[k][3], lo[3]);
            if constexpr (SPLIT) {
#pragma unroll
                for (int j = 0; j < 4; ++j) ql[k][j] = lo[j];
            }
        }
    }

    const int tiles = max(0, (hi - lo + LATENT_KEYS - 1) / LATENT_KEYS);
    // Copy tile `tile` (keys lo + LATENT_KEYS * tile ..) into its slot (keys past hi zero-filled, never read); one
    // commit group either way.
    auto fetch = [&](int tile) {
        if (tile < tiles) {
            unsigned char* const slot = WIDEN ? raw_s + tile % LATENT_STAGES * RAW_TILE
                                              : latent_shared + tile % LATENT_STAGES * TILE * 2;
#pragma unroll 3
            for (int i = threadIdx.x; i < TILE_COPIES; i += THREADS) {
                const int row = i / ROW_COPIES, d = (i % ROW_COPIES) * ELEMENTS;
                const int j = lo + LATENT_KEYS * tile + row;
                const bool in = j < hi;
                const int key = in ? j : lo;  // a valid address; nothing is read where !in
                const long long at = (table[key / block_size] * block_size + key % block_size) * DK + d;
                unsigned char* target = slot + (WIDEN ? row * DK + d : 2 * (row * STRIDE + d));
                copy_async(reinterpret_cast<uint4*>(target), cache + at, in);
            }
        }
        copy_commit();
    };
    fetch(0);

    const float scale_log2 = scale * LOG2_E;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};  // rows r, r + 8: running max (log2 units), lane sum
    float o[DTILES][4] = {};
    const int matrix = lane / 8;  // the 8 x 8 matrix whose row this lane addresses in ldmatrix
    const int value_at = ((matrix & 1) * 8 + lane % 8) * STRIDE + (matrix >> 1) * 8 + quarter * WARP_DIMS;
    const int key_at = ((matrix >> 1) * 8 + lane % 8) * STRIDE + (matrix & 1) * 8 + k_dim0;
    for (int i = 0; i < tiles; ++i) {
        copy_wait<0>();   // this thread's copies of tile i have landed
        __syncthreads();  // ... every thread's; and every warp is done with tile i - 1
        const __nv_bfloat16* rows = tiles_s + (WIDEN ? 0 : i % LATENT_STAGES * TILE);
        if constexpr (WIDEN) {
            const unsigned char* raw = raw_s + i % LATENT_STAGES * RAW_TILE;
            for (int chunk = threadIdx.x; chunk < RAW_TILE / 16; chunk += THREADS) {
                const int row = chunk / (DK / 16), d = chunk % (DK / 16) * 16;
                uint4 halves[2];
                fp8x16_to_half(*reinterpret_cast<const uint4*>(raw + 16 * chunk), halves);
                uint4* target = reinterpret_cast<uint4*>(tiles_s + row * STRIDE + d);
                target[0] = halves[0];
                target[1] = halves[1];
            }
        }
        fetch(i + 1);  // into the slot of tile i - 1, which every warp is done with
        if constexpr (WIDEN) __syncthreads();  // the widened rows are visible to the block

        // This warp's partial scores of rows r (0, 1) and r + 8 (2, 3), keys 8n + 2c (+1) of the tile: the high
        // parts' products, then the low parts', in one accumulator per n-tile (NTILES independent mma chains). The
        // keys' B fragments of n-tiles 2j and 2j + 1 come in one ldmatrix: keys lane % 8 (+ 8 from lane 16 on), dims
        // + 8 for lanes 8-15 and 24-31.
        float s[NTILES][4] = {};
#pragma unroll
        for (int j = 0; j < NTILES / 2; ++j) {
#pragma unroll
            for (int k = 0; k < KSTEPS; ++k) {
                unsigned b[4];
                load_matrices(&rows[key_at + j * 16 * STRIDE + k * 16], b);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    M::mma(s[2 * j + h], qa[k][0], qa[k][1], qa[k][2], qa[k][3], b[2 * h], b[2 * h + 1]);
                    if constexpr (SPLIT) {
                        M::mma(s[2 * j + h], ql[k][0], ql[k][1], ql[k][2], ql[k][3], b[2 * h], b[2 * h + 1]);
                    }
                }
            }
        }
#pragma unroll
        for (int n = 0; n < NTILES; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) partial_s[warp][n][e][lane] = s[n][e];
        }
        __syncthreads();  // every warp's partials are written

        const int key0 = lo + LATENT_KEYS * i;
        float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int n = 0; n < NTILES; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float score = 0.f;
#pragma unroll
                for (int w = 0; w < LATENT_WARPS; ++w) score += partial_s[group * LATENT_WARPS + w][n][e][lane];
                s[n][e] = key0 + n * 8 + 2 * c + (e & 1) < hi ? score * scale_log2 : neg_inf();
                tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
            }
        }
        float reference[2];
        online_softmax_step(m, l, o, tile_max, reference);
        exponentiate(s, reference, l);
        add_values<Op, SPLIT>(s, rows, value_at, STRIDE, o);  // O += P V over this warp's dims
    }
    copy_wait<0>();

    const float row_sum[2] = {quad_sum(l[0]), quad_sum(l[1])};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int head = head0 + r + 8 * h;
        if (head >= num_heads) continue;
        const long long row = static_cast<long long>(t) * num_heads + head;  // [T, Q]
        const int d0 = quarter * WARP_DIMS + 2 * c;
        if (range.splits == 1) {  // the split holds key `pos`: row_sum >= 1
            const float factor = v_scale / row_sum[h];
#pragma unroll
            for (int n = 0; n < DTILES; ++n) {
                *reinterpret_cast<float2*>(out + row * R + d0 + n * 8) =
                    make_float2(o[n][2 * h] * factor, o[n][2 * h + 1] * factor);
            }
        } else {
            const long long part = row * gridDim.z + split;  // [T, Q, S]
#pragma unroll
            for (int n = 0; n < DTILES; ++n) {
                *reinterpret_cast<float2*>(partial_acc + part * R + d0 + n * 8) =
                    make_float2(o[n][2 * h] * v_scale, o[n][2 * h + 1] * v_scale);
            }
            if (quarter == 0 && c == 0) {
                partial_ml[2 * part] = m[h] == neg_inf() ? m[h] : m[h] * 0.6931471805599453f;  // log2 -> natural
                partial_ml[2 * part + 1] = row_sum[h];
            }
        }
    }
}
