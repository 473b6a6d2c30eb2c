// Launch contract
//
// Multi-head Latent Attention's prefill in the decompressed form: the cached latent rows of the sequences a step
// prefills are taken back through kv_b_proj to each head's key (no-rope part) and value, once a layer, and every
// query head attends with its own query [q_nope | rotated q_rope] over [k_nope | rotated rope key] and its values,
// N + ROPE multiply-adds a key for the score and DV for the output (192 + 128 for DeepSeek-V3) instead of the
// absorbed form's R + ROPE and R (576 + 512, latent_attention.cu), which decode steps keep: their one token a
// sequence would not repay decompressing its context.
//
// latent_gather<KV, W>: the cached rows [latent (R) | rotated rope key (ROPE)] of the decompressed sequences' whole
// contexts, contiguous.
//   cache KV [num_blocks * block_size, R + ROPE] (float, __nv_bfloat16, __half or __nv_fp8_e4m3 as stored);
//   block_tables int64 [B, max_blocks] (the step's); seqs int32 [S]: the step's sequence index of each decompressed
//   sequence; key_start int64 [S + 1]: row key_start[s] + j of the outputs is position j of sequence s's context;
//   latent W [C, R] (out: the rows' latent parts times kv_scale, rounded to W, the up-projections' type);
//   rope __nv_bfloat16 [C, ROPE] (out: the rotated rope keys times kv_scale).
//   grid: (C), block: 128 threads, a row each.
//
// latent_prefill_attention<N, ROPE, DV>: causal attention of the decompressed sequences' query tokens on tensor
// cores (mma.sync.m16n8k16, bf16 operands, float32 accumulation), flash-style: online softmax over tiles of
// PREFILL_KEYS keys, no score matrix in memory.
//   q float32 [T, Q, N + ROPE] (each token's [q_nope | rotated q_rope], latent_rope_write's query without the
//   absorption), 8-byte aligned; kv __nv_bfloat16 [C, Q, N + DV] (each context row's key no-rope part and value,
//   head by head); rope __nv_bfloat16 [C, ROPE] (latent_gather's); key_start int64 [S + 1] and seqs int32 [S] as
//   latent_gather's; query_start int64 [B + 1], positions int64 [T] (the step's); tiles int32 [M, 2]: (decompressed
//   sequence s, first query row r0) of each block's PREFILL_ROWS query tokens, the longest key ranges first;
//   out float32 [T, Q, DV]: the rows of the decompressed sequences' tokens (others are not written).
//   Token t = query_start[seqs[s]] + r0 + i at position p attends to keys j = 0 .. p of its context (rows
//   key_start[s] + j); scores are scaled by `scale`.
//   grid: (M, Q), block: PREFILL_THREADS, dynamic shared memory prefill_shared_bytes: PREFILL_STAGES tiles of keys
//   [PREFILL_KEYS][N + ROPE + FLASH_PAD] and values [PREFILL_KEYS][DV + FLASH_PAD] bf16.
// Block (m, h) takes query head h of PREFILL_ROWS consecutive tokens (rows past the sequence's end: position -1,
// every key masked, never written); warp w owns rows 16w .. 16w + 15 and holds their queries, rounded to bf16, as A
// fragments for the block's life. The tiles stream through a ring of PREFILL_STAGES slots by cp.async (the next
// while this one is multiplied); keys past the block's last position are zero-filled and masked. The keys' B
// fragments come by ldmatrix, two n-tiles a load; the values' by ldmatrix.trans, as flash_attention.cu's.
// Numerics: bf16 operands (q, k, v, the probabilities), float32 scores, softmax (base 2) and accumulation: the
// matmul precision "medium" of the backend (about 1e-3 of float32 attention).
#include "flash.cuh"

constexpr int PREFILL_ROWS = 64;  // query tokens per block
constexpr int PREFILL_WARPS = PREFILL_ROWS / 16;
constexpr int PREFILL_THREADS = PREFILL_WARPS * 32;
constexpr int PREFILL_KEYS = 64;    // keys per tile
constexpr int PREFILL_STAGES = 2;   // ring slots of key and value tiles

template <typename KV, typename W>
__global__ void __launch_bounds__(128)
latent_gather(const KV* __restrict__ cache, const long long* __restrict__ block_tables, const int* __restrict__ seqs,
              const long long* __restrict__ key_start, int num_seqs, int max_blocks, int block_size, int R, int rope,
              float kv_scale, W* __restrict__ latent, __nv_bfloat16* __restrict__ rope_rows) {
    pdl_wait();
    const long long i = blockIdx.x;
    int s = 0;  // the last sequence whose rows start at or before row i
    for (int hi = num_seqs - 1; s < hi;) {
        const int mid = (s + hi + 1) / 2;
        if (key_start[mid] <= i) s = mid; else hi = mid - 1;
    }
    const long long j = i - key_start[s];
    const long long* table = block_tables + static_cast<long long>(seqs[s]) * max_blocks;
    const KV* row = cache + (table[j / block_size] * block_size + j % block_size) * (R + rope);
    for (int d = threadIdx.x; d < R + rope; d += blockDim.x) {
        const float v = to_float(row[d]) * kv_scale;
        if (d < R) latent[i * R + d] = from_float<W>(v);
        else rope_rows[i * rope + d - R] = __float2bfloat16(v);
    }
}

template <int N, int ROPE, int DV>
__global__ void __launch_bounds__(PREFILL_THREADS, 2)
latent_prefill_attention(const float* __restrict__ q, const __nv_bfloat16* __restrict__ kv,
                         const __nv_bfloat16* __restrict__ rope, const long long* __restrict__ key_start,
                         const int* __restrict__ seqs, const long long* __restrict__ query_start,
                         const long long* __restrict__ positions, const int* __restrict__ tiles,
                         float* __restrict__ out, int num_heads, float scale) {
    constexpr int DK = N + ROPE;                 // dims of a query and key
    constexpr int KV_WIDTH = N + DV;             // elements of a head's row in kv
    constexpr int K_STRIDE = DK + FLASH_PAD;     // bf16 per shared key row
    constexpr int V_STRIDE = DV + FLASH_PAD;     // bf16 per shared value row
    constexpr int SLOT = PREFILL_KEYS * (K_STRIDE + V_STRIDE);  // bf16 of one ring slot: keys, then values
    constexpr int KSTEPS = DK / 16;              // k-steps of S = Q K^T
    constexpr int DTILES = DV / 8;               // n-tiles of the output
    constexpr int NTILES = PREFILL_KEYS / 8;     // n-tiles of S
    constexpr int N_COPIES = N / 8, ROPE_COPIES = ROPE / 8, V_COPIES = DV / 8;  // 16-byte copies of a key's parts
    constexpr int KEY_COPIES = N_COPIES + ROPE_COPIES + V_COPIES;
    static_assert(N % 16 == 0 && ROPE % 16 == 0 && DV % 16 == 0, "whole k-steps and ldmatrix tiles");
    static_assert(PREFILL_KEYS * KEY_COPIES % PREFILL_THREADS == 0, "a tile's copies spread evenly over the threads");
    using M = Mma<__nv_bfloat16>;
    extern __shared__ __align__(16) unsigned char prefill_shared[];
    __nv_bfloat16* const ring = reinterpret_cast<__nv_bfloat16*>(prefill_shared);
    pdl_wait();

    const int s = tiles[2 * blockIdx.x], row0 = tiles[2 * blockIdx.x + 1], head = blockIdx.y;
    const long long start = query_start[seqs[s]];
    const int rows = static_cast<int>(query_start[seqs[s] + 1] - start) - row0;  // this block's valid rows
    const long long keys0 = key_start[s];  // the sequence's first context row in kv and rope
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, c = lane % 4;
    const int row_a = warp * 16 + r, row_b = row_a + 8;
    const int pos[2] = {row_a < rows ? static_cast<int>(positions[start + row0 + row_a]) : -1,
                        row_b < rows ? static_cast<int>(positions[start + row0 + row_b]) : -1};
    const int key_hi = static_cast<int>(positions[start + row0 + min(rows, PREFILL_ROWS) - 1]) + 1;  // keys [0, key_hi)

    // This warp's rows r and r + 8 as A fragments of bf16 (zeros for padding rows).
    unsigned qa[KSTEPS][4];
    {
        const float2 zero = make_float2(0.f, 0.f);
        const float* qrow_a = q + ((start + row0 + min(row_a, rows - 1)) * num_heads + head) * DK;
        const float* qrow_b = q + ((start + row0 + min(row_b, rows - 1)) * num_heads + head) * DK;
#pragma unroll
        for (int k = 0; k < KSTEPS; ++k) {
            const int d = k * 16 + 2 * c;
            const float2 a0 = pos[0] >= 0 ? *reinterpret_cast<const float2*>(qrow_a + d) : zero;
            const float2 a2 = pos[0] >= 0 ? *reinterpret_cast<const float2*>(qrow_a + d + 8) : zero;
            const float2 b0 = pos[1] >= 0 ? *reinterpret_cast<const float2*>(qrow_b + d) : zero;
            const float2 b2 = pos[1] >= 0 ? *reinterpret_cast<const float2*>(qrow_b + d + 8) : zero;
            qa[k][0] = M::pack(a0.x, a0.y);
            qa[k][1] = M::pack(b0.x, b0.y);
            qa[k][2] = M::pack(a2.x, a2.y);
            qa[k][3] = M::pack(b2.x, b2.y);
        }
    }

    // Copy the tile of keys tile0 .. tile0 + PREFILL_KEYS - 1 into ring slot `slot`: each key's no-rope part and rope
    // part side by side as its key row, its value as its value row; keys at or past key_hi zero-filled, never read.
    // One commit group either way.
    auto fetch = [&](int tile0, int slot) {
        if (tile0 < key_hi) {
            __nv_bfloat16* const keys_s = ring + slot * SLOT;
            __nv_bfloat16* const values_s = keys_s + PREFILL_KEYS * K_STRIDE;
#pragma unroll 4
            for (int u = 0; u < PREFILL_KEYS * KEY_COPIES / PREFILL_THREADS; ++u) {
                const int i = threadIdx.x + u * PREFILL_THREADS, key = i / KEY_COPIES, part = i % KEY_COPIES;
                const int j = tile0 + key;
                const bool in = j < key_hi;
                const long long row = keys0 + (in ? j : 0);  // a valid address; nothing is read where !in
                const __nv_bfloat16* head_row = kv + (row * num_heads + head) * KV_WIDTH;
                __nv_bfloat16* target;
                const __nv_bfloat16* source;
                if (part < N_COPIES) {
                    target = keys_s + key * K_STRIDE + part * 8;
                    source = head_row + part * 8;
                } else if (part < N_COPIES + ROPE_COPIES) {
                    target = keys_s + key * K_STRIDE + part * 8;
                    source = rope + row * ROPE + (part - N_COPIES) * 8;
                } else {
                    target = values_s + key * V_STRIDE + (part - N_COPIES - ROPE_COPIES) * 8;
                    source = head_row + N + (part - N_COPIES - ROPE_COPIES) * 8;
                }
                copy_async(reinterpret_cast<uint4*>(target), source, in);
            }
        }
        copy_commit();
    };

    const float scale_log2 = scale * LOG2_E;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};  // rows r, r + 8: running max (log2 units), lane sum
    float o[DTILES][4] = {};
    const int matrix = lane / 8;  // the 8 x 8 matrix whose row this lane addresses in ldmatrix
    const int key_at = ((matrix >> 1) * 8 + lane % 8) * K_STRIDE + (matrix & 1) * 8;
    const int value_at = ((matrix & 1) * 8 + lane % 8) * V_STRIDE + (matrix >> 1) * 8;
    fetch(0, 0);
    for (int i = 0, tile0 = 0; tile0 < key_hi; ++i, tile0 += PREFILL_KEYS) {
        fetch(tile0 + PREFILL_KEYS, (i + 1) % PREFILL_STAGES);  // the next tile streams in while this one is used
        copy_wait<PREFILL_STAGES - 1>();
        __syncthreads();
        const __nv_bfloat16* const keys_s = ring + i % PREFILL_STAGES * SLOT;
        const __nv_bfloat16* const values_s = keys_s + PREFILL_KEYS * K_STRIDE;

        // S = Q K^T; the keys' B fragments of n-tiles 2j and 2j + 1 in one ldmatrix.
        float sc[NTILES][4] = {};  // scores of rows r (0, 1) and r + 8 (2, 3), keys tile0 + 8n + 2c (+1)
#pragma unroll
        for (int j = 0; j < NTILES / 2; ++j) {
#pragma unroll
            for (int k = 0; k < KSTEPS; ++k) {
                unsigned b[4];
                load_matrices(&keys_s[key_at + j * 16 * K_STRIDE + k * 16], b);
                M::mma(sc[2 * j], qa[k][0], qa[k][1], qa[k][2], qa[k][3], b[0], b[1]);
                M::mma(sc[2 * j + 1], qa[k][0], qa[k][1], qa[k][2], qa[k][3], b[2], b[3]);
            }
        }
        float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int n = 0; n < NTILES; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = tile0 + n * 8 + 2 * c + (e & 1);
                sc[n][e] = j <= pos[e / 2] ? sc[n][e] * scale_log2 : neg_inf();
                tile_max[e / 2] = fmaxf(tile_max[e / 2], sc[n][e]);
            }
        }
        float reference[2];
        online_softmax_step(m, l, o, tile_max, reference);
        exponentiate(sc, reference, l);

        add_values<__nv_bfloat16, false>(sc, values_s, value_at, V_STRIDE, o);  // O += P V
        __syncthreads();  // every warp is done with this slot before a later fetch refills it
    }
    copy_wait<0>();

    const float row_sum[2] = {quad_sum(l[0]), quad_sum(l[1])};  // the whole warp shuffles, padding rows too
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = h == 0 ? row_a : row_b;
        if (row >= rows) continue;
        const float inverse = 1.f / row_sum[h];  // > 0: a row always sees its own position's key
        float* out_row = out + ((start + row0 + row) * num_heads + head) * DV;
#pragma unroll
        for (int n = 0; n < DTILES; ++n) {
            *reinterpret_cast<float2*>(out_row + n * 8 + 2 * c) =
                make_float2(o[n][2 * h] * inverse, o[n][2 * h + 1] * inverse);
        }
    }
}
