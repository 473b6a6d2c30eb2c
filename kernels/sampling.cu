// Launch contract
//
// argmax_rows: greedy token of each row: the index of the largest logit, the lowest index among equal ones.
//   logits float32 [B, V] contiguous; ids int64 [B].
//   grid.x: B, block: 1024 threads (32 warps).
//
// feed_tokens: a step's input tokens taken from the step before it on the device (scheduling one step ahead):
//   ids[b] = feedback[rows[b]] where rows[b] >= 0, else ids[b] unchanged.
//   ids int64 [B]; rows int64 [B]; feedback int64 [F], the earlier step's sampled ids, rows[b] < F.
//   grid.x: ceil(B / 256), block: 256 threads.
//
// top_candidates: of each listed row, the `count` largest logits divided by the row's temperature (float32,
//   rounded to nearest), largest first, equal values by lower id first (-0 equals +0), and the row's exp sum:
//   the sum over the row of floor(exp(x - max) * 2^bits), x the scaled logits, exp from + and * alone
//   (fixed_exp), 0 where x - max < cutoff. Every output is exact: colibri_stream/exact_softmax.py computes the same
//   bits with NumPy (top_sorted, exp_sums, fixed_point).
//   logits float32 [N, V] contiguous; rows int32 [R] (the rows of logits to read); temperature float32 [R];
//   ids int32 [R, count]; values float32 [R, count]; sums uint64 [R]. 1 <= count <= min(V, MAX_CANDIDATES),
//   V * 2^bits < 2^63.
//   grid.x: R, block: SELECT_THREADS (1024) threads; static shared memory only (about 9 KiB).
//   With draws (else null): also draws each row's token over the whole vocabulary into tokens int64 [R], the walk
//   of sampling._walk without min-p: weights fixed_exp(x - max) in the order the candidates, largest first, then
//   every other token by id; the token is the first whose cumulative weight exceeds floor(u * sum), u = draws[r]
//   / 2^53 (draws uint64 [R], below 2^53). Integers throughout, so the token is the host's. A row whose temperature
//   is not above 0 is skipped (nothing written): a decode graph's greedy rows.
#include "common.cuh"

#define MAX_CANDIDATES 1024
#define SELECT_THREADS 1024

extern "C" __global__ void argmax_rows(const float* __restrict__ logits, long long* __restrict__ ids, int V) {
    pdl_wait();
    __shared__ float best_values[32];
    __shared__ int best_indices[32];
    const float* row = logits + static_cast<long long>(blockIdx.x) * V;
    float best = neg_inf();
    int index = V;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = row[i];
        if (v > best || index == V) { best = v; index = i; }  // indices rise per thread: ties keep the first
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(FULL_MASK, best, offset);
        const int other_index = __shfl_xor_sync(FULL_MASK, index, offset);
        if (other > best || (other == best && other_index < index)) { best = other; index = other_index; }
    }
    if (lane == 0) { best_values[warp] = best; best_indices[warp] = index; }
    __syncthreads();
    if (warp == 0) {
        best = lane < static_cast<int>(blockDim.x / 32) ? best_values[lane] : neg_inf();
        index = lane < static_cast<int>(blockDim.x / 32) ? best_indices[lane] : V;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(FULL_MASK, best, offset);
            const int other_index = __shfl_xor_sync(FULL_MASK, index, offset);
            if (other > best || (other == best && other_index < index)) { best = other; index = other_index; }
        }
        if (lane == 0) ids[blockIdx.x] = index;
    }
}

extern "C" __global__ void feed_tokens(long long* __restrict__ ids, const long long* __restrict__ rows,
                                       const long long* __restrict__ feedback, int B) {
    pdl_wait();
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < B && rows[b] >= 0) ids[b] = feedback[rows[b]];
}

// A float's bits as an unsigned key of the same order; -0 is taken as +0 (NumPy compares them equal).
__device__ __forceinline__ unsigned int order_key(float x) {
    const unsigned int bits = __float_as_uint(x == 0.f ? 0.f : x);
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

__device__ __forceinline__ float key_value(unsigned int key) {
    return __uint_as_float((key & 0x80000000u) ? key & 0x7fffffffu : ~key);
}

// Scaled logit i of a row as a 64-bit key: larger value first, then lower id first. Keys of a row are distinct.
__device__ __forceinline__ unsigned long long candidate_key(const float* row, int i, float temperature) {
    const unsigned int key = order_key(__fdiv_rn(row[i], temperature));
    return (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - static_cast<unsigned int>(i));
}

// floor(exp(y) * 2^bits) for y <= 0, 0 below cutoff: exp(y) = 2^k exp(r), k = rint(y log2(e)),
// r = y - k ln2 (ln2 split in two), exp(r) by Horner over its Taylor series to degree 11. Only correctly rounded
// operations, never fused (the _rn intrinsics), in the order of sampling.exp_sums.
__device__ __forceinline__ unsigned long long fixed_exp(double y, int bits, double cutoff) {
    constexpr double LOG2E = 1.4426950408889634;
    constexpr double LN2_HI = 6.93147180369123816490e-01;
    constexpr double LN2_LO = 1.90821492927058770002e-10;
    constexpr double TAYLOR[12] = {0x1.0000000000000p+0, 0x1.0000000000000p+0, 0x1.0000000000000p-1,
                                   0x1.5555555555555p-3, 0x1.5555555555555p-5, 0x1.1111111111111p-7,
                                   0x1.6c16c16c16c17p-10, 0x1.a01a01a01a01ap-13, 0x1.a01a01a01a01ap-16,
                                   0x1.71de3a556c734p-19, 0x1.27e4fb7789f5cp-22, 0x1.ae64567f544e4p-26};
    if (!(y >= cutoff)) return 0ull;
    const double k = rint(__dmul_rn(y, LOG2E));
    const double r = __dsub_rn(__dsub_rn(y, __dmul_rn(k, LN2_HI)), __dmul_rn(k, LN2_LO));
    double p = TAYLOR[11];
#pragma unroll
    for (int j = 10; j >= 0; --j) p = __dadd_rn(__dmul_rn(p, r), TAYLOR[j]);
    return static_cast<unsigned long long>(floor(ldexp(p, static_cast<int>(k) + bits)));
}

// One block per row. Radix select over the 64-bit keys, 8 bits a pass from the top, finds the smallest key T
// such that exactly `count` keys are >= T (a pass ends the search once the bucket holding the count-th key
// fits whole); those keys are gathered, sorted descending (bitonic, in shared memory) and written out; a last
// pass adds up the row's fixed_exp terms against the largest value.
// Inclusive sum of v over the block (blockDim.x a multiple of 32); `warp_totals` [32] shared scratch. Every thread
// must call it.
__device__ __forceinline__ unsigned long long block_inclusive_sum(unsigned long long v,
                                                                  unsigned long long* warp_totals) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const unsigned long long other = __shfl_up_sync(FULL_MASK, v, offset);
        if (lane >= offset) v += other;
    }
    __syncthreads();  // an earlier call's readers are done with warp_totals
    if (lane == 31) warp_totals[warp] = v;
    __syncthreads();
    if (warp == 0) {
        unsigned long long total = lane < static_cast<int>(blockDim.x / 32) ? warp_totals[lane] : 0ull;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const unsigned long long other = __shfl_up_sync(FULL_MASK, total, offset);
            if (lane >= offset) total += other;
        }
        warp_totals[lane] = total;
    }
    __syncthreads();
    return v + (warp > 0 ? warp_totals[warp - 1] : 0ull);
}

extern "C" __global__ void __launch_bounds__(SELECT_THREADS) top_candidates(const float* __restrict__ logits, const int* __restrict__ rows,
                                          const float* __restrict__ temperature, int V, int count, int bits,
                                          double cutoff, int* __restrict__ ids, float* __restrict__ values,
                                          unsigned long long* __restrict__ sums,
                                          const unsigned long long* __restrict__ draws,
                                          long long* __restrict__ tokens) {
    pdl_wait();
    __shared__ unsigned int histogram[256];
    __shared__ unsigned long long keys[MAX_CANDIDATES];
    __shared__ unsigned long long chosen_prefix, partial[SELECT_THREADS / 32], partial_scan[32], row_total, walked;
    __shared__ int chosen_remaining, chosen_done, filled, found;
    const float* row = logits + static_cast<long long>(rows[blockIdx.x]) * V;
    const float t = temperature[blockIdx.x];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (draws != nullptr && !(t > 0.f)) return;  // the same for the whole block

    unsigned long long prefix = 0ull, mask = 0ull;  // the digits of T chosen so far, and where they are
    int remaining = count;  // keys still to take among those matching the prefix
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) histogram[d] = 0u;
        __syncthreads();
        for (int base = 0; base < V; base += blockDim.x) {  // whole warps iterate together
            const int i = base + threadIdx.x;
            const unsigned long long key = i < V ? candidate_key(row, i, t) : 0ull;
            const bool counted = i < V && (key & mask) == prefix;
            const unsigned int digit = static_cast<unsigned int>(key >> shift) & 255u;
            const unsigned int voters = __ballot_sync(FULL_MASK, counted);
            if (counted) {
                const unsigned int peers = __match_any_sync(voters, digit);
                if (__ffs(peers) - 1 == lane) atomicAdd(&histogram[digit], static_cast<unsigned int>(__popc(peers)));
            }
        }
        __syncthreads();
        if (warp == 0) {  // lane l holds digits 255 - 8l down to 248 - 8l; find the one holding the remaining-th key
            unsigned int bucket[8], total = 0u;
#pragma unroll
            for (int j = 0; j < 8; ++j) { bucket[j] = histogram[255 - 8 * lane - j]; total += bucket[j]; }
            unsigned int above = total;  // inclusive scan over the lanes: keys in higher digits
#pragma unroll
            for (int offset = 1; offset < 32; offset <<= 1) {
                const unsigned int other = __shfl_up_sync(FULL_MASK, above, offset);
                if (lane >= offset) above += other;
            }
            above -= total;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const unsigned int need = static_cast<unsigned int>(remaining);
                if (above < need && above + bucket[j] >= need) {
                    chosen_prefix = prefix | (static_cast<unsigned long long>(255 - 8 * lane - j) << shift);
                    chosen_remaining = static_cast<int>(need - above);
                    chosen_done = bucket[j] == need - above;
                }
                above += bucket[j];
            }
        }
        __syncthreads();
        prefix = chosen_prefix;
        remaining = chosen_remaining;
        mask |= 0xffull << shift;
        if (chosen_done) break;  // the same shared value in every thread
    }

    // Gather the keys >= T (exactly count of them), pad to a power of two with 0 (below every key), sort.
    int size = 1;
    while (size < count) size <<= 1;
    if (threadIdx.x == 0) filled = 0;
    for (int j = count + threadIdx.x; j < size; j += blockDim.x) keys[j] = 0ull;
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const unsigned long long key = candidate_key(row, i, t);
        if (key >= prefix) keys[atomicAdd(&filled, 1)] = key;
    }
    __syncthreads();
    for (int span = 2; span <= size; span <<= 1) {
        for (int stride = span / 2; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < size; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    const unsigned long long a = keys[i], b = keys[j];
                    if (((i & span) == 0) == (a < b)) { keys[i] = b; keys[j] = a; }  // descending runs first
                }
            }
            __syncthreads();
        }
    }
    const long long out = static_cast<long long>(blockIdx.x) * count;
    for (int j = threadIdx.x; j < count; j += blockDim.x) {
        const unsigned long long key = keys[j];
        ids[out + j] = static_cast<int>(0xffffffffu - static_cast<unsigned int>(key));
        values[out + j] = key_value(static_cast<unsigned int>(key >> 32));
    }

    const double top = static_cast<double>(key_value(static_cast<unsigned int>(keys[0] >> 32)));
    unsigned long long sum = 0ull;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        sum += fixed_exp(__dsub_rn(static_cast<double>(__fdiv_rn(row[i], t)), top), bits, cutoff);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, offset);
    if (lane == 0) partial[warp] = sum;
    __syncthreads();
    if (warp == 0) {
        sum = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : 0ull;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, offset);
        if (lane == 0) {
            sums[blockIdx.x] = sum;
            row_total = sum;
        }
    }
    if (draws == nullptr) return;  // the same for the whole block

    // The draw: target = floor(draw * total / 2^53), exact in 128 bits.
    __syncthreads();
    const unsigned long long draw = draws[blockIdx.x], total = row_total;
    const unsigned long long target = (__umul64hi(draw, total) << 11) | ((draw * total) >> 53);
    if (threadIdx.x == 0) found = 0;
    // The candidates first, largest first: a thread each (count <= blockDim.x).
    const int j = threadIdx.x;
    const unsigned long long weight = j < count
        ? fixed_exp(__dsub_rn(static_cast<double>(key_value(static_cast<unsigned int>(keys[j] >> 32))), top), bits,
                    cutoff)
        : 0ull;
    const unsigned long long upto = block_inclusive_sum(weight, partial_scan);
    if (j < count && upto > target && upto - weight <= target) {
        tokens[blockIdx.x] = static_cast<long long>(0xffffffffu - static_cast<unsigned int>(keys[j]));
        found = 1;
    }
    if (j == count - 1) walked = upto;
    __syncthreads();
    if (found) return;
    // Then every other token by id: each thread a run of ids, the runs' sums scanned, the run holding the target
    // walked again one id at a time.
    const int run = (V + blockDim.x - 1) / blockDim.x;
    const int begin = min(threadIdx.x * run, V), end = min(begin + run, V);
    unsigned long long mine = 0ull;
    for (int i = begin; i < end; ++i) {
        if (candidate_key(row, i, t) < prefix) {
            mine += fixed_exp(__dsub_rn(static_cast<double>(__fdiv_rn(row[i], t)), top), bits, cutoff);
        }
    }
    const unsigned long long after = walked + block_inclusive_sum(mine, partial_scan);
    if (after > target && after - mine <= target) {
        unsigned long long running = after - mine;
        for (int i = begin; i < end; ++i) {
            if (candidate_key(row, i, t) < prefix) {
                running += fixed_exp(__dsub_rn(static_cast<double>(__fdiv_rn(row[i], t)), top), bits, cutoff);
                if (running > target) {
                    tokens[blockIdx.x] = i;
                    break;
                }
            }
        }
    }
}
