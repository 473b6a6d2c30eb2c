// Launch contract (flash_decode, the decode kernel of this file, has its own below)
//
// flash_attention<KV, D, SPLIT>: causal attention of prefill chunks over the paged KV cache on tensor cores
// (mma.sync.m16n8k16, bf16 operands, float32 accumulation), flash-style: online softmax over tiles of keys, no score
// matrix in memory. The same attention as attention.cu's paged_attention, for many query tokens per sequence.
//   q            float32 [T, Q, D] contiguous, 16-byte aligned; out float32 [T, Q, D]
//   key_cache,
//   value_cache  KV [num_blocks, block_size, K, D] (KV: float, __nv_bfloat16 or __half), 16-byte aligned
//   block_tables int64 [B, max_blocks]: KV blocks of each sequence
//   query_start  int64 [B + 1]: sequence b owns tokens query_start[b] .. query_start[b + 1] - 1
//   positions    int64 [T], ascending inside each sequence (a chunk's tokens are consecutive positions)
//   tiles        int32 [N, 2]: (sequence b, first row r0) of each block's FLASH_ROWS query rows; the backend lists
//                them longest key range first, so the blocks with most work start first
//   Token t of sequence b at position p, head h, reads KV head h / (Q / K) at cached positions j <= p, and only
//   j > p - window when window > 0; scores are scaled by `scale`.
//   sinks        float32 [Q] or null: sink logits, as attention.cu's kernels take them (flash_decode too)
//   D: 64, 96 or 128 (a multiple of 16, at most 128: the accumulators of 16 rows x D fit in registers).
//   grid: (N, K), block: FLASH_THREADS, dynamic shared memory: the tiles' rows of D + 8 bf16, FLASH_STAGES * 2 * 64
//   of them for a bf16 cache (68 KiB at D = 128; the launch raises the kernel's limit), else 2 * FLASH_ROWS (34
//   KiB), plus the rows' positions in static shared memory. ptxas (sm_90): SPLIT bounded for 2 blocks a
//   multiprocessor, up to 249 registers, no spills; without SPLIT for 3, up to 168 registers, 24-40 bytes spilled
//   at D = 96 and 128.
// Tiles: a bf16 cache's keys and values are mma operands as stored, so its tiles are copied with cp.async into a
//   ring of FLASH_STAGES slots (PIPELINED): the next tile streams in while the block multiplies this one. Other
//   caches are converted on the way (split into bf16 parts), so each tile is loaded through registers and stored
//   before the block multiplies it.
//
// Rows: the query rows of sequence b for KV head k are its (token, group head) pairs, token-major: row i is token
// query_start[b] + i / group, query head k * group + i % group (group = Q / K), so one tile of keys and values in
// shared memory serves every query head of its KV head. Block (n, k) takes rows r0 .. r0 + FLASH_ROWS - 1 of its
// sequence (those past the sequence's last row are padding: position -1, every key masked, never written); warp w
// owns rows 16w .. 16w + 15 of them. The block's keys run from the first key its first row sees to its last row's
// position, in tiles of KEYS (32 with SPLIT_KV, else 64) aligned to multiples of KEYS; keys of a tile outside that
// range are zero-filled in shared memory (never read from the cache) and masked.
//
// Numerics: scores, the softmax (base 2, scale * log2 e), the row sums and the output accumulate in float32.
// SPLIT: each float32 operand x of the products (q, the probabilities p, and k and v where bf16 does not hold the
// cache's type exactly: SPLIT_KV) is staged as x = hi + lo, hi its bf16 rounding and lo the bf16 rounding of the
// rest (about 16 significant bits, as the backend's projections split their activations), and each product sums
// the partial products hi hi, lo hi and hi lo (lo lo is below 2^-16 of the result): within about 1e-5 of float32
// attention, at 2 (bf16 cache) or 3 times the mma of bf16 operands. Without SPLIT, q, k, v and p are rounded to
// bf16 (about 1e-3).
//
// mma fragments (PTX ISA, m16n8k16; r = lane / 4, c = lane % 4; pairs of bf16 in one 32-bit register, the lower
// index in the low half):
//   A (16 x 16, row-major): a0 {row r, k 2c, 2c+1}, a1 {row r+8, k 2c..}, a2 {row r, k 2c+8..}, a3 {row r+8, k 2c+8..}
//   B (16 x 8, k x n):      b0 {k 2c, 2c+1; column r}, b1 {k 2c+8, 2c+9; column r}
//   C (16 x 8, float):      c0, c1 {row r, columns 2c, 2c+1}, c2, c3 {row r+8, columns 2c, 2c+1}
// S = Q K^T: A from the staged queries (registers for the whole block's life), B from K rows in shared memory
// (a key's k-pair is two consecutive dims of its row: one 32-bit read). P V: the C fragments of S for key columns
// 16s .. 16s + 15 (n-tiles 2s and 2s+1) are the A fragment of k-step s as they stand (rows r, r+8; keys 2c.., 2c+8..),
// packed to bf16 (split into hi and lo); B (keys x dims) from V rows by ldmatrix.trans: each 8 x 8 matrix of 8 key rows and 8 dims, loaded
// transposed, gives lane l the pair {keys 2c, 2c+1; dim r}, which is b0 (keys 0-7 of the k-step) or b1 (keys 8-15).
// Shared rows are padded to D + 8 bf16, so the 8 rows a fragment read or an ldmatrix phase touches start 16 bytes
// apart modulo 128: no bank conflicts.
#include "flash.cuh"

constexpr int FLASH_ROWS = 64;   // query rows per block
constexpr int FLASH_WARPS = FLASH_ROWS / 16;
constexpr int FLASH_THREADS = FLASH_WARPS * 32;
constexpr int FLASH_STAGES = 2;  // ring slots of key and value tiles of a bf16 cache (PIPELINED)

__device__ __forceinline__ void split8(const float (&x)[8], uint4& hi, uint4& lo) {
    split_pair(x[0], x[1], hi.x, lo.x);
    split_pair(x[2], x[3], hi.y, lo.y);
    split_pair(x[4], x[5], hi.z, lo.z);
    split_pair(x[6], x[7], hi.w, lo.w);
}

// Eight consecutive elements of a cache or query row (16-byte aligned), through the read-only path, as eight bf16
// high parts and eight low parts. EXACT: bf16 holds the element type exactly (the low parts are zero).
template <typename T> struct Bf16x8;

template <> struct Bf16x8<float> {
    static constexpr bool EXACT = false;
    __device__ __forceinline__ static void load(const float* p, uint4& hi, uint4& lo) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(p));
        const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
        split8({a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w}, hi, lo);
    }
};

template <> struct Bf16x8<__nv_bfloat16> {
    static constexpr bool EXACT = true;
    __device__ __forceinline__ static void load(const __nv_bfloat16* p, uint4& hi, uint4& lo) {
        hi = __ldg(reinterpret_cast<const uint4*>(p));
        lo = make_uint4(0, 0, 0, 0);
    }
};

template <> struct Bf16x8<__half> {
    static constexpr bool EXACT = false;
    __device__ __forceinline__ static void load(const __half* p, uint4& hi, uint4& lo) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
        const float2 a = Mma<__half>::unpack(raw.x), b = Mma<__half>::unpack(raw.y);
        const float2 c = Mma<__half>::unpack(raw.z), d = Mma<__half>::unpack(raw.w);
        split8({a.x, a.y, b.x, b.y, c.x, c.y, d.x, d.y}, hi, lo);
    }
};

// Stage keys (or values) tile0 .. tile0 + KEYS - 1 of KV head kv in shared memory as bf16 rows of D + 8, the high
// parts in hi_rows and, with LO, the low parts in lo_rows: those outside [key_lo, key_hi) are zeros, never read
// from the cache. Each thread's chunks of 8 elements are all loaded before any is stored, so their memory round
// trips overlap instead of following one another.
template <typename KV, int D, int KEYS, bool LO>
__device__ __forceinline__ void stage_tile(const KV* __restrict__ cache, const long long* __restrict__ table,
                                           int tile0, int key_lo, int key_hi, int block_size, int num_kv_heads,
                                           int kv, __nv_bfloat16* hi_rows, __nv_bfloat16* lo_rows) {
    constexpr int CHUNKS = D / 8;                          // 16-byte chunks of bf16 per row
    constexpr int STAGED = KEYS * CHUNKS / FLASH_THREADS;  // ... of the tile per thread
    static_assert(KEYS * CHUNKS % FLASH_THREADS == 0, "a tile's chunks spread evenly over the threads");
    uint4 hi[STAGED], lo[STAGED];
#pragma unroll
    for (int u = 0; u < STAGED; ++u) {
        const int i = threadIdx.x + u * FLASH_THREADS, j = tile0 + i / CHUNKS, d = (i % CHUNKS) * 8;
        hi[u] = lo[u] = make_uint4(0, 0, 0, 0);
        if (j >= key_lo && j < key_hi) {
            const long long slot = table[j / block_size] * block_size + j % block_size;
            Bf16x8<KV>::load(cache + (slot * num_kv_heads + kv) * D + d, hi[u], lo[u]);
        }
    }
#pragma unroll
    for (int u = 0; u < STAGED; ++u) {
        const int i = threadIdx.x + u * FLASH_THREADS;
        const int at = (i / CHUNKS) * (D + FLASH_PAD) + (i % CHUNKS) * 8;
        *reinterpret_cast<uint4*>(&hi_rows[at]) = hi[u];
        if constexpr (LO) *reinterpret_cast<uint4*>(&lo_rows[at]) = lo[u];
    }
}

template <typename KV, int D, bool SPLIT>
__global__ void __launch_bounds__(FLASH_THREADS, SPLIT ? 2 : 3)
flash_attention(const float* __restrict__ q, const KV* __restrict__ key_cache, const KV* __restrict__ value_cache,
                const long long* __restrict__ block_tables, const long long* __restrict__ query_start,
                const long long* __restrict__ positions, const int* __restrict__ tiles, float* __restrict__ out,
                int num_heads, int num_kv_heads, int block_size, int max_blocks, float scale, int window,
                const float* __restrict__ sinks) {
    static_assert(D % 16 == 0 && D <= 128, "D is a multiple of 16 up to 128");
    constexpr bool SPLIT_KV = SPLIT && !Bf16x8<KV>::EXACT;  // keys and values in high and low parts too
    constexpr int KEYS = SPLIT_KV ? 32 : 64;  // keys per tile
    constexpr int STRIDE = D + FLASH_PAD;     // bf16 per shared row
    constexpr int CHUNKS = D / 8;             // 16-byte chunks of bf16 per row
    constexpr int KSTEPS = D / 16;            // k-steps of S = Q K^T
    constexpr int DTILES = D / 8;             // n-tiles of the output
    constexpr int NTILES = KEYS / 8;          // n-tiles of S
    static_assert((SPLIT_KV ? 4 : 2) * KEYS == 2 * FLASH_ROWS, "the key tiles fill the queries' shared rows");
    // First the queries' high and low parts [2][FLASH_ROWS][STRIDE]; then, over them, the tiles: with PIPELINED
    // FLASH_STAGES slots of [k, v][KEYS][STRIDE], else one set [k hi, v hi, k lo, v lo][KEYS][STRIDE] (the low
    // parts only with SPLIT_KV).
    constexpr bool PIPELINED = Bf16x8<KV>::EXACT;
    extern __shared__ __align__(16) unsigned char flash_shared[];
    __nv_bfloat16* const shared_rows = reinterpret_cast<__nv_bfloat16*>(flash_shared);
    __shared__ int row_pos_s[FLASH_ROWS];  // position of each row's token, -1 for padding rows
    __nv_bfloat16* const q_hi = shared_rows;
    __nv_bfloat16* const q_lo = shared_rows + FLASH_ROWS * STRIDE;
    constexpr int LO_AT = SPLIT_KV ? 2 * KEYS * STRIDE : 0;  // the low parts' tiles (none without SPLIT_KV)
    pdl_wait();

    const int seq = tiles[2 * blockIdx.x], row0 = tiles[2 * blockIdx.x + 1];
    const int kv = blockIdx.y;
    const int group = num_heads / num_kv_heads;
    const long long start = query_start[seq];
    const int rows = static_cast<int>(query_start[seq + 1] - start) * group - row0;  // this block's valid rows
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, c = lane % 4;
    const long long* table = block_tables + static_cast<long long>(seq) * max_blocks;

    // Stage the queries (high and low bf16 parts) and each row's position.
    for (int i = threadIdx.x; i < FLASH_ROWS * CHUNKS; i += FLASH_THREADS) {
        const int row = i / CHUNKS, d = (i % CHUNKS) * 8;
        uint4 hi = make_uint4(0, 0, 0, 0), lo = hi;
        if (row < rows) {
            const int pair = row0 + row;
            const long long t = start + pair / group;
            const int h = kv * group + pair % group;
            Bf16x8<float>::load(q + (t * num_heads + h) * D + d, hi, lo);
        }
        *reinterpret_cast<uint4*>(&q_hi[row * STRIDE + d]) = hi;
        if constexpr (SPLIT) *reinterpret_cast<uint4*>(&q_lo[row * STRIDE + d]) = lo;
    }
    if (threadIdx.x < FLASH_ROWS) {
        const int row = threadIdx.x;
        row_pos_s[row] = row < rows ? static_cast<int>(positions[start + (row0 + row) / group]) : -1;
    }
    __syncthreads();

    // This warp's 16 query rows as A fragments: high parts, and low parts with SPLIT.
    unsigned qa[KSTEPS][4], ql[SPLIT ? KSTEPS : 1][4];
    const int row_a = warp * 16 + r, row_b = row_a + 8;
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
        const int a = row_a * STRIDE + s * 16 + 2 * c, b = row_b * STRIDE + s * 16 + 2 * c;
        qa[s][0] = shared_pair(&q_hi[a]);
        qa[s][1] = shared_pair(&q_hi[b]);
        qa[s][2] = shared_pair(&q_hi[a + 8]);
        qa[s][3] = shared_pair(&q_hi[b + 8]);
        if constexpr (SPLIT) {
            ql[s][0] = shared_pair(&q_lo[a]);
            ql[s][1] = shared_pair(&q_lo[b]);
            ql[s][2] = shared_pair(&q_lo[a + 8]);
            ql[s][3] = shared_pair(&q_lo[b + 8]);
        }
    }
    const int pos[2] = {row_pos_s[row_a], row_pos_s[row_b]};
    const int first_pos = row_pos_s[0], last_pos = row_pos_s[min(rows, FLASH_ROWS) - 1];
    const int key_lo = window > 0 ? max(0, first_pos - window + 1) : 0;  // the block's keys [key_lo, key_hi)
    const int key_hi = last_pos + 1;
    const float scale_log2 = scale * LOG2_E;
    __syncthreads();  // every warp holds its queries before the key tiles overwrite them

    using M = Mma<__nv_bfloat16>;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};  // rows r, r + 8: running max (log2 units), lane sum
    float o[DTILES][4] = {};
    // The 8 x 8 matrix whose row this lane addresses in ldmatrix: keys + 8 (bit 0), dims + 8 (bit 1).
    const int matrix = lane / 8;
    const int value_at = ((matrix & 1) * 8 + lane % 8) * STRIDE + (matrix >> 1) * 8;
    // PIPELINED: copy the tile of keys and values from tile0 into ring slot `slot` with cp.async (keys outside
    // [key_lo, key_hi) zero-filled, never read); one commit group either way.
    auto fetch = [&](int tile0, int slot) {
        if (tile0 < key_hi) {
            __nv_bfloat16* const k_slot = shared_rows + slot * 2 * KEYS * STRIDE;
#pragma unroll
            for (int u = 0; u < KEYS * CHUNKS / FLASH_THREADS; ++u) {
                const int i = threadIdx.x + u * FLASH_THREADS, row = i / CHUNKS, d = (i % CHUNKS) * 8;
                const int j = tile0 + row;
                const bool in = j >= key_lo && j < key_hi;
                const int key = in ? j : key_lo;  // a valid address; nothing is read where !in
                const long long at = ((table[key / block_size] * block_size + key % block_size) * num_kv_heads + kv)
                                     * D + d;
                copy_async(reinterpret_cast<uint4*>(&k_slot[row * STRIDE + d]), key_cache + at, in);
                copy_async(reinterpret_cast<uint4*>(&k_slot[(KEYS + row) * STRIDE + d]), value_cache + at, in);
            }
        }
        copy_commit();
    };
    const int first_tile = key_lo / KEYS * KEYS;
    if constexpr (PIPELINED) fetch(first_tile, 0);
    for (int i = 0, tile0 = first_tile; tile0 < key_hi; ++i, tile0 += KEYS) {
        __nv_bfloat16* k_hi = shared_rows;
        if constexpr (PIPELINED) {
            fetch(tile0 + KEYS, (i + 1) % FLASH_STAGES);  // the next tile streams in while this one is used
            copy_wait<FLASH_STAGES - 1>();
            k_hi = shared_rows + i % FLASH_STAGES * 2 * KEYS * STRIDE;
        } else {
            stage_tile<KV, D, KEYS, SPLIT_KV>(key_cache, table, tile0, key_lo, key_hi, block_size, num_kv_heads, kv,
                                              k_hi, shared_rows + LO_AT);
            stage_tile<KV, D, KEYS, SPLIT_KV>(value_cache, table, tile0, key_lo, key_hi, block_size, num_kv_heads,
                                              kv, k_hi + KEYS * STRIDE, shared_rows + LO_AT + KEYS * STRIDE);
        }
        const __nv_bfloat16* const v_hi = k_hi + KEYS * STRIDE;
        const __nv_bfloat16* const k_lo = shared_rows + LO_AT;  // read only with SPLIT_KV
        const __nv_bfloat16* const v_lo = k_lo + KEYS * STRIDE;
        __syncthreads();

        // S = Q K^T: q_hi k_hi, + q_lo k_hi with SPLIT, + q_hi k_lo with SPLIT_KV (q_lo k_lo is below 2^-16).
        float s[NTILES][4] = {};  // scores of rows r (0, 1) and r + 8 (2, 3), keys tile0 + 8n + 2c (+1)
#pragma unroll
        for (int n = 0; n < NTILES; ++n) {
            const int at = (n * 8 + r) * STRIDE + 2 * c;
#pragma unroll
            for (int k = 0; k < KSTEPS; ++k) {
                const unsigned b0 = shared_pair(&k_hi[at + k * 16]), b1 = shared_pair(&k_hi[at + k * 16 + 8]);
                M::mma(s[n], qa[k][0], qa[k][1], qa[k][2], qa[k][3], b0, b1);
                if constexpr (SPLIT) M::mma(s[n], ql[k][0], ql[k][1], ql[k][2], ql[k][3], b0, b1);
                if constexpr (SPLIT_KV) {
                    M::mma(s[n], qa[k][0], qa[k][1], qa[k][2], qa[k][3], shared_pair(&k_lo[at + k * 16]),
                           shared_pair(&k_lo[at + k * 16 + 8]));
                }
            }
        }

        float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int n = 0; n < NTILES; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = tile0 + n * 8 + 2 * c + (e & 1), p = pos[e / 2];
                const bool visible = j <= p && (window <= 0 || j > p - window);
                s[n][e] = visible ? s[n][e] * scale_log2 : neg_inf();
                tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
            }
        }
        float reference[2];
        online_softmax_step(m, l, o, tile_max, reference);
        exponentiate(s, reference, l);

        // O += P V: p_hi v_hi, + p_lo v_hi with SPLIT, then + p_hi v_lo with SPLIT_KV.
        add_values<__nv_bfloat16, SPLIT>(s, v_hi, value_at, STRIDE, o);
        if constexpr (SPLIT_KV) add_values<__nv_bfloat16, false>(s, v_lo, value_at, STRIDE, o);
        __syncthreads();  // every warp is done with this tile before the next one is staged
    }
    copy_wait<0>();

    const float row_sum[2] = {quad_sum(l[0]), quad_sum(l[1])};  // the whole warp shuffles, padding rows too
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = h == 0 ? row_a : row_b;
        if (row >= rows) continue;
        const int pair = row0 + row;
        const long long t = start + pair / group;
        const int head = kv * group + pair % group;
        const float sink = sinks != nullptr ? exp2f(sinks[head] * LOG2_E - m[h]) : 0.f;  // m[h]: the row's max
        const float inverse = 1.f / (row_sum[h] + sink);  // > 0: a row always sees its own position's key
        float* out_row = out + (t * num_heads + head) * D;
#pragma unroll
        for (int n = 0; n < DTILES; ++n) {
            *reinterpret_cast<float2*>(out_row + n * 8 + 2 * c) =
                make_float2(o[n][2 * h] * inverse, o[n][2 * h + 1] * inverse);
        }
    }
}

// ---- decode -------------------------------------------------------------------------------------------------------
// flash_decode<KV, D, STAGES>: one query token per sequence (T == B; token t is sequence t unless query_start says
// otherwise) over the paged cache on tensor cores, flash-decoding style: the same attention and the same splits as
// attention.cu's paged_attention_gqa (split z of the token's S_t = decode_splits(n, split_keys, S) takes keys
// [lo, hi) of its n, idle splits return at once), and the same outputs: out where S_t == 1, else the unnormalised
// partials partial_acc [T, Q, S, D] / partial_ml [T, Q, S, 2] (m in natural-log units) that attention.cu's
// paged_attention_merge combines.
//   KV: __nv_bfloat16 or __half, used as stored as the mma operands, exactly; or __nv_fp8_e4m3, whose tiles are
//   copied as bytes into the back of their ring slot and widened in place to __half (exact) before use.
//   D: 64, 96 or 128. The query group (Q / K heads of one KV head, at most 16) forms the 16 rows of one m-tile;
//   rows past the group are zero queries, never written. q is split into high and low parts of the operand type
//   (about 16 significant bits) and so are the probabilities, as flash_attention's SPLIT does: within about 1e-5 of
//   float32.
//   STAGES: ring slots per warp (at least 2).
//   grid: (T, K, S), block: DECODE_THREADS, dynamic shared memory: DECODE_WARPS * STAGES key and value tiles of
//   DECODE_KEYS rows of D + 8 elements (17 KiB per stage at D = 128; above 48 KiB the launch raises the kernel's
//   limit), reused for the warps' merge.
//   Warp w of a block takes the split's tiles of DECODE_KEYS keys w, w + DECODE_WARPS, ...; its lanes copy each tile
//   into the warp's own ring of STAGES slots with cp.async (keys past hi zero-filled, never read), so STAGES - 1
//   tiles and their block-table reads are in flight while one is used, and no block barrier is needed until the
//   merge.
//   k_scale is folded into `scale` by the backend; v_scale multiplies the outputs.
constexpr int DECODE_WARPS = 2;
constexpr int DECODE_THREADS = DECODE_WARPS * 32;
constexpr int DECODE_KEYS = 16;   // keys per tile: two n-tiles of S, one k-step of P V

// Lane `lane`'s share of widening one fp8 tile of DECODE_KEYS rows of D in place: the bytes at `raw` ([rows][D],
// the back of the slot) become __half rows of `stride` at `rows` (the front). Every lane reads its bytes before any
// lane writes (the two overlap).
template <int D>
__device__ __forceinline__ void widen_fp8_tile(__nv_bfloat16* rows, const unsigned char* raw, int stride, int lane) {
    constexpr int CHUNKS = DECODE_KEYS * D / 16;  // 16-byte chunks of the tile, 16 elements each
    constexpr int PER_LANE = (CHUNKS + 31) / 32;
    uint4 bytes[PER_LANE];
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) {
        const int i = lane + 32 * u;
        if (i < CHUNKS) bytes[u] = *reinterpret_cast<const uint4*>(raw + 16 * i);
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) {
        const int i = lane + 32 * u;
        if (i >= CHUNKS) continue;
        const int row = i / (D / 16), d = (i % (D / 16)) * 16;
        uint4 halves[2];
        fp8x16_to_half(bytes[u], halves);
        uint4* out = reinterpret_cast<uint4*>(&rows[row * stride + d]);
        out[0] = halves[0];
        out[1] = halves[1];
    }
}

template <typename KV, int D, int STAGES>
__global__ void __launch_bounds__(DECODE_THREADS, 4)
flash_decode(const float* __restrict__ q, const KV* __restrict__ key_cache, const KV* __restrict__ value_cache,
             const long long* __restrict__ block_tables, const long long* __restrict__ query_start,
             const long long* __restrict__ positions, float* __restrict__ out, float* __restrict__ partial_acc,
             float* __restrict__ partial_ml, int num_seqs, int num_heads, int num_kv_heads, int block_size,
             int max_blocks, float scale, int window, float v_scale, const float* __restrict__ sinks,
             int split_keys) {
    static_assert(D % 16 == 0 && D <= 128, "D is a multiple of 16 up to 128");
    constexpr int STRIDE = D + FLASH_PAD;  // elements per shared row
    constexpr int KSTEPS = D / 16;         // k-steps of S = Q K^T
    constexpr int DTILES = D / 8;          // n-tiles of the output
    constexpr int TILE = DECODE_KEYS * STRIDE;
    constexpr bool WIDEN = sizeof(KV) == 1;              // fp8: tiles copied as bytes, widened before use
    constexpr int ELEMENTS = 16 / sizeof(KV);            // cache elements per 16-byte copy
    constexpr int ROW_COPIES = D / ELEMENTS;             // 16-byte copies per cached row
    constexpr int COPIES = DECODE_KEYS * ROW_COPIES / 32;  // ... per lane per key (or value) tile
    constexpr int RAW_AT = 2 * TILE - DECODE_KEYS * D;   // bytes into a slot tile where an fp8 tile's bytes land
    static_assert(DECODE_KEYS * ROW_COPIES % 32 == 0, "a tile's chunks spread evenly over the lanes");
    static_assert(STAGES >= 2 && STAGES * 2 * TILE * 2 >= 16 * D * 4,
                  "a warp's ring holds its 16 x D float accumulators");
    using Op = typename DecodeOperand<KV>::type;
    using M = Mma<Op>;
    // [warp][stage][keys, values][DECODE_KEYS rows of STRIDE]: the bits of KV elements
    extern __shared__ __align__(16) unsigned char decode_shared[];
    auto ring_s = reinterpret_cast<__nv_bfloat16 (*)[STAGES][2][TILE]>(decode_shared);
    __shared__ float m_s[DECODE_WARPS][16], l_s[DECODE_WARPS][16];
    pdl_wait();

    const int t = blockIdx.x, kv = blockIdx.y, split = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, c = lane % 4;
    const int group = num_heads / num_kv_heads;
    const DecodeSplit range = decode_split(static_cast<int>(positions[t]), window, split_keys, split, gridDim.z);
    if (split >= range.splits) return;  // the token's splits are fewer than the launch's: this block is idle
    const int splits = range.splits, lo = range.lo, hi = range.hi;  // this split's keys [lo, hi)
    const long long* table = decode_table(t, num_seqs, query_start, block_tables, max_blocks);

    // Rows r and r + 8 of the m-tile (query heads kv * group + row; zero past the group) as A fragments.
    unsigned qa[KSTEPS][4], ql[KSTEPS][4];
    {
        const long long head0 = static_cast<long long>(t) * num_heads + kv * group;
        const float* row_a = q + (head0 + min(r, group - 1)) * D;
        const float* row_b = q + (head0 + min(r + 8, group - 1)) * D;
        const bool in_a = r < group, in_b = r + 8 < group;
        const float2 zero = make_float2(0.f, 0.f);
#pragma unroll
        for (int k = 0; k < KSTEPS; ++k) {
            const int d = k * 16 + 2 * c;
            const float2 a0 = in_a ? *reinterpret_cast<const float2*>(row_a + d) : zero;
            const float2 a2 = in_a ? *reinterpret_cast<const float2*>(row_a + d + 8) : zero;
            const float2 b0 = in_b ? *reinterpret_cast<const float2*>(row_b + d) : zero;
            const float2 b2 = in_b ? *reinterpret_cast<const float2*>(row_b + d + 8) : zero;
            split_pair_as<Op>(a0.x, a0.y, qa[k][0], ql[k][0]);
            split_pair_as<Op>(b0.x, b0.y, qa[k][1], ql[k][1]);
            split_pair_as<Op>(a2.x, a2.y, qa[k][2], ql[k][2]);
            split_pair_as<Op>(b2.x, b2.y, qa[k][3], ql[k][3]);
        }
    }

    const int tiles = max(0, (hi - lo + DECODE_KEYS - 1) / DECODE_KEYS);
    // Copy tile `tile` (keys lo + DECODE_KEYS * tile ..) into ring slot `slot`; one commit group either way.
    auto fetch = [&](int tile, int slot) {
        if (tile < tiles) {
#pragma unroll
            for (int u = 0; u < COPIES; ++u) {
                const int i = lane + 32 * u, row = i / ROW_COPIES, d = (i % ROW_COPIES) * ELEMENTS;
                const int j = lo + DECODE_KEYS * tile + row;
                const bool in = j < hi;
                const int key = in ? j : lo;  // a valid address; nothing is read where !in
                const long long at = ((table[key / block_size] * block_size + key % block_size) * num_kv_heads + kv)
                                     * D + d;
#pragma unroll
                for (int part = 0; part < 2; ++part) {  // keys, values
                    unsigned char* target = reinterpret_cast<unsigned char*>(ring_s[warp][slot][part]);
                    target += WIDEN ? RAW_AT + row * D + d : 2 * (row * STRIDE + d);
                    copy_async(reinterpret_cast<uint4*>(target), (part == 0 ? key_cache : value_cache) + at, in);
                }
            }
        }
        copy_commit();
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) fetch(warp + s * DECODE_WARPS, s);

    const float scale_log2 = scale * LOG2_E;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};  // rows r, r + 8: running max (log2 units), lane sum
    float o[DTILES][4] = {};
    const int matrix = lane / 8;  // the 8 x 8 matrix whose row this lane addresses in ldmatrix
    const int value_at = ((matrix & 1) * 8 + lane % 8) * STRIDE + (matrix >> 1) * 8;
    for (int i = 0, tile = warp; tile < tiles; ++i, tile += DECODE_WARPS) {
        fetch(tile + (STAGES - 1) * DECODE_WARPS, (i + STAGES - 1) % STAGES);
        copy_wait<STAGES - 1>();  // this tile's group is complete (the later ones may still run)
        __syncwarp();             // ... and every lane's copies are visible to the warp
        const __nv_bfloat16* keys = ring_s[warp][i % STAGES][0];
        const __nv_bfloat16* values = ring_s[warp][i % STAGES][1];
        if constexpr (WIDEN) {
#pragma unroll
            for (int part = 0; part < 2; ++part) {
                __nv_bfloat16* rows = ring_s[warp][i % STAGES][part];
                widen_fp8_tile<D>(rows, reinterpret_cast<const unsigned char*>(rows) + RAW_AT, STRIDE, lane);
            }
            __syncwarp();  // the widened rows are visible to the warp
        }

        // scores of rows r (0, 1) and r + 8 (2, 3), keys 8n + 2c (+1) of the tile: the high parts' products and the
        // low parts' in accumulators of their own (four independent mma chains), added after
        float s[2][4] = {}, s_lo[2][4] = {};
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            const int at = (n * 8 + r) * STRIDE + 2 * c;
#pragma unroll
            for (int k = 0; k < KSTEPS; ++k) {
                const unsigned b0 = shared_pair(&keys[at + k * 16]), b1 = shared_pair(&keys[at + k * 16 + 8]);
                M::mma(s[n], qa[k][0], qa[k][1], qa[k][2], qa[k][3], b0, b1);
                M::mma(s_lo[n], ql[k][0], ql[k][1], ql[k][2], ql[k][3], b0, b1);
            }
        }
        const int key0 = lo + DECODE_KEYS * tile;
        float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] = key0 + n * 8 + 2 * c + (e & 1) < hi ? (s[n][e] + s_lo[n][e]) * scale_log2 : neg_inf();
                tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
            }
        }
        float reference[2];
        online_softmax_step(m, l, o, tile_max, reference);
        exponentiate(s, reference, l);
        // O += P V over the tile's 16 keys: p_hi v + p_lo v.
        unsigned ph[4], pl[4];
        probability_fragment<Op>(s, 0, ph, pl);
#pragma unroll
        for (int n = 0; n < DTILES / 2; ++n) {  // dims 16n .. 16n + 15: output n-tiles 2n, 2n + 1
            unsigned bv[4];
            load_matrices_transposed(&values[value_at + n * 16], bv);
            M::mma(o[2 * n], ph[0], ph[1], ph[2], ph[3], bv[0], bv[1]);
            M::mma(o[2 * n + 1], ph[0], ph[1], ph[2], ph[3], bv[2], bv[3]);
            M::mma(o[2 * n], pl[0], pl[1], pl[2], pl[3], bv[0], bv[1]);
            M::mma(o[2 * n + 1], pl[0], pl[1], pl[2], pl[3], bv[2], bv[3]);
        }
        __syncwarp();  // every lane has read this slot before a later fetch refills it
    }
    copy_wait<0>();

    // Merge the warps per row in shared memory (each warp's ring holds its accumulators), weight exp2(m_w - M).
    const float row_sum[2] = {quad_sum(l[0]), quad_sum(l[1])};
    float* o_s = reinterpret_cast<float*>(&ring_s[warp][0][0][0]);  // [16, D] this warp's accumulators
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = r + 8 * h;
        if (c == 0) { m_s[warp][row] = m[h]; l_s[warp][row] = row_sum[h]; }
#pragma unroll
        for (int n = 0; n < DTILES; ++n) {
            *reinterpret_cast<float2*>(&o_s[row * D + n * 8 + 2 * c]) = make_float2(o[n][2 * h], o[n][2 * h + 1]);
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < group * D; e += DECODE_THREADS) {
        const int g = e / D, d = e % D;
        float top = neg_inf();
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) top = fmaxf(top, m_s[w][g]);
        float total = 0.f, a = 0.f;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) {
            const float weight = m_s[w][g] == neg_inf() ? 0.f : exp2f(m_s[w][g] - top);  // 0 for a warp without keys
            total += l_s[w][g] * weight;
            a = fmaf(reinterpret_cast<const float*>(&ring_s[w][0][0][0])[g * D + d], weight, a);
        }
        a *= v_scale;
        const long long row = static_cast<long long>(t) * num_heads + kv * group + g;  // [T, Q]
        if (splits == 1) {  // key `first` is this block's: total >= 1
            const float sink = sinks != nullptr ? exp2f(sinks[kv * group + g] * LOG2_E - top) : 0.f;
            out[row * D + d] = a / (total + sink);
        } else {
            const long long part = row * gridDim.z + split;  // [T, Q, S]
            partial_acc[part * D + d] = a;
            if (d == 0) {
                partial_ml[2 * part] = top == neg_inf() ? top : top * 0.6931471805599453f;  // log2 -> natural log
                partial_ml[2 * part + 1] = total;
            }
        }
    }
}
