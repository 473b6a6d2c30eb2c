"""Launch shapes and thresholds of the CUDA kernels: every number the GPU backend picks a kernel or a block by.

Two kinds live here. Mirrors of a kernel's own constants (marked "= X in file.cu") must change together with the
.cu file. Thresholds choose between two correct paths by speed; they were chosen from decode and step-kernel runs
on the GPUs the benchmark record names (BENCHMARKS.md), and any value gives the same results within the parity
tolerances.
"""

# ---- dense projections (linear.cu, linear_mma.cu, cuBLAS) ------------------------------------------------------
SMALL_BATCH = 4  # up to this many tokens (or in a graph capture off tensor cores), projections use linear_rows
TOKEN_TILES = (1, 2, 4, 8)  # linear_rows and per_head_rows instantiations: tokens per block
# up to this many tokens (or in a graph capture), latent attention's per-head up-projections use per_head_rows (more
# tokens: one batched product of the widened weights)
PER_HEAD_ROWS_MAX_TOKENS = 64
LINEAR_ROWS_PER_BLOCK = 2  # = LINEAR_ROWS in linear.cu
DENSE_MMA_MIN_TOKENS = 4  # from this many tokens, captured bf16/fp16 projections run on linear_mma
CAPTURED_CUBLAS_MIN_TOKENS = 8  # ... and from this many, those of CAPTURED_CUBLAS_MIN_ROWS rows or more (lm_head) on
CAPTURED_CUBLAS_MIN_ROWS = 16384  # cuBLAS, called inside the capture through captured_cublas.py
CAPTURED_CUBLAS_ALL_MIN_TOKENS = 32  # ... and from this many, every captured bf16/fp16 projection on cuBLAS
LINEAR_MMA_TILES = (1, 2, 4, 8)  # linear_mma instantiations: n-tiles of 8 tokens per pass over the weights
LINEAR_MMA_ROWS = 128  # output rows per block of linear_mma: 4 warps x 32
LINEAR_MMA_BLOCKS_PER_SM = 4  # blocks of 48 KiB shared memory a multiprocessor runs at once: what the splits fill
LINEAR_MMA_MIN_SPAN = 128  # columns per split at least (four 32-column chunks)

EMBEDDING_THREADS = 256  # = EMBEDDING_THREADS in embedding.cu

# ---- routed experts (moe.cu on CUDA cores, moe_mma.cu on tensor cores) -----------------------------------------
MOE_TILES = (1, 2, 4, 8)  # moe_gate_up / moe_down instantiations: pairs of one expert per pass
MOE_WARPS = 4  # warps per block of the MoE kernels (moe.cu)
MOE_ROWS_PER_WARP = (1, 2, 4)  # moe_gate_up / moe_down instantiations: weight rows per warp
# A warp of moe.cu takes rows of its matrix until they hold this many bytes (up to 4 rows): fewer, longer rows per
# warp for moe_down, whose rows (I elements) are short; gate and up rows (H elements) one or two at a time.
MOE_UP_ROW_BYTES = 8192
MOE_DOWN_ROW_BYTES = 65536
MMA_MIN_TOKENS = 8  # from this many tokens a step, bf16/fp16 routed experts run on tensor cores (moe_mma.cu)
MMA_TILES = (1, 2, 4)  # moe_gate_up_mma / moe_down_mma instantiations: n-tiles of 8 pairs per pass over the weights
MMA_THREADS = 128  # = MMA_WARPS * 32 in moe_mma.cu (and linear_mma.cu)
MMA_GATE_UP_ROWS = 64  # gate (and up) rows per block of moe_gate_up_mma: 4 warps x 16
MMA_DOWN_ROWS = 128  # down rows per block of moe_down_mma: 4 warps x 32
# moe_gate_up_int4's KW instantiations: a block's 4 warps take 64 rows (1), or share 16, a quarter of the columns
# each (4 = MMA_WARPS), when fewer blocks of 64 rows than this many per multiprocessor would run (Qwen3-MoE's
# 768-row experts at batch 1: 96 blocks on 132 multiprocessors)
INT4_ROW_SHARING = 4
INT4_SHARED_ROWS_BELOW_BLOCKS_PER_SM = 2
# int4 and mxfp4 routed experts run on moe_int4_gemv.cu (CUDA cores, a warp's lanes along each row) up to this many
# tokens a step, on moe_int4.cu's tensor cores from one more (the faster of the two up to 2 tokens, the slower at 4:
# benchmarks/moe_formats.py --variant INT4_GEMV_MAX_TOKENS=0, BENCHMARKS.md)
INT4_GEMV_MAX_TOKENS = 2
INT4_GEMV_TILES = (1, 2, 4)  # moe_int4_gemv.cu's TT instantiations: pairs of one expert per pass
INT4_GEMV_ROWS = 2  # moe_int4_gemv.cu's R: rows per warp (of gate and of up each, or of down)
# An eager step's bf16/fp16 routed experts run as cuBLAS GEMMs per expert (cupy_expert_gemm.py) when one expert's
# gate product at the step's average group size (pairs / E * H * I multiply-adds) is at least this much work: each
# GEMM costs a fixed host call and a host read of the group sizes, so only few, large experts (Mixtral's 8, from
# about 70 pairs each) take them; below, from GROUPED_GEMM_MIN_PAIRS pairs per expert on average, one grouped GEMM
# per matrix (moe_gemm.cu: tiles of GEMM_PAIRS pairs, each weight read once per tile), below that moe_mma.cu
# (benchmarks/moe_prefill.py measures the crossovers).
EXPERT_GEMM_MIN_WORK = 1 << 32
GROUPED_GEMM_MIN_PAIRS = 32
GEMM_PAIRS = 64  # = GEMM_PAIRS in moe_gemm.cu: pairs per block
GEMM_ROWS = 128  # = GEMM_ROWS in moe_gemm.cu: down rows per block
GEMM_FEATURES = 64  # gate (and up) rows per block of moe_gemm_gate_up: GEMM_ROWS / 2
GEMM_THREADS = 128  # = GEMM_THREADS in moe_gemm.cu
GEMM_MAX_GROUPS = 1024  # = GEMM_MAX_GROUPS in moe_gemm.cu: experts of a layer moe_gemm_tiles scans at most

# ---- attention (attention.cu, attention_prologue.cu) -----------------------------------------------------------
ATTENTION_WARPS = 16  # = ATTN_WARPS in attention.cu
GQA_WARPS = 4  # = GQA_WARPS in attention.cu: warps per block of paged_attention_gqa
GQA_GROUPS = (1, 2, 4, 8, 16)  # paged_attention_gqa instantiations: query heads per KV head, rounded up to one
GQA_MAX_LANE_FLOATS = 64  # G * DPL (q floats per lane, as many accumulators) above this: paged_attention instead
GQA_MAX_SPLITS = 32  # paged_attention_gqa splits a context over at most this many blocks (then a merge launch)
GQA_BLOCKS_PER_SM = 2  # ... and over as many as make T * K * splits about this many blocks per multiprocessor
GQA_SPLIT_KEYS = 16  # ... at the tables' full width; a token's context is cut into splits of about this many keys
#                      (at most the launch's): a short context leaves most of the launch's blocks idle
GQA_MIN_TOKENS = 2  # a single token takes paged_attention, whose block per query head is then the shorter path,
GQA_ONE_TOKEN_MAX_KEYS = 2048  # ... unless its tables hold more keys: one block per query head walks the whole
#                                context, where the GQA kernel reads each key once for the group, split over the GPU
# flash_decode (flash_attention.cu) takes a decode launch of a bf16 / fp16 cache whose tables hold at least this
# many keys; its splits as paged_attention_gqa's, with constants of its own
FLASH_DECODE_MIN_KEYS = 0
FLASH_DECODE_MAX_SPLITS = 128
FLASH_DECODE_BLOCKS_PER_SM = 4
FLASH_DECODE_SPLIT_KEYS = 64
FLASH_DECODE_STAGES = 2  # key and value tiles in flight per warp of flash_decode, plus the one in use: its ring slots
# latent_attention (latent_attention.cu): splits as flash_decode's, with constants of its own (its blocks take 16 query
# heads of a token, so a token of DeepSeek-V3's 128 heads is 8 blocks a split)
LATENT_KERNEL_SHAPES = ((512, 64),)  # its (kv_lora_rank, rope width) instantiations: DeepSeek-V3's and Kimi K2's
LATENT_MAX_SPLITS = 64
LATENT_BLOCKS_PER_SM = 2
LATENT_SPLIT_KEYS = 256
# its instantiations by m-tiles of 16 query heads a block: a launch whose tokens alone fill the GPU
# (LATENT_BLOCKS_PER_SM blocks a multiprocessor of one m-tile each, unsplit: prefill chunks) takes the widest, whose
# blocks read each key tile once for more heads; decode launches take one m-tile, more blocks to split a context over
LATENT_HEAD_TILES = (1, 2)
# latent_prefill.cu: prefill chunks in the decompressed form (cupy_latent_prefill.py). Its (no-rope, rope, value)
# head widths: DeepSeek-V3's, Kimi K2's and DeepSeek-V2's
LATENT_PREFILL_SHAPES = ((128, 64, 128),)
# a sequence's chunk of this many tokens or more takes it: decompressing the context costs about as much as the
# absorbed form's extra products over it for some 40 query tokens
LATENT_PREFILL_MIN_TOKENS = 64
# bytes a step's decompressed contexts may take at most (keys' no-rope parts and values of every head, bf16); the
# sequences past it keep the absorbed form
LATENT_PREFILL_MAX_BYTES = 2 << 30
MERGE_MAX_SPLITS = 1024  # = MERGE_MAX_SPLITS in attention.cu: the splits paged_attention_merge takes at most
MERGE_THREADS = 256  # = MERGE_WARPS * 32 in attention.cu: threads of a paged_attention_merge block
PROLOGUE_WARPS = 4  # warps per block of qk_norm_rope_write (attention_prologue.cu) without a full-width qk norm

# ---- routing (router.cu) ---------------------------------------------------------------------------------------
ROUTER_SPLIT_TOKENS = 64  # up to this many tokens, route_split spreads the router's rows over the GPU
# route_split's tokens per block at most: its last block of a tile selects for them, a warp a token, so ROUTER_WARPS
# of them select in one round
ROUTER_TILE = 4
ROUTER_WARPS = 4  # = ROUTER_WARPS in router.cu
# router.cu's selection marks a lane's chosen experts in one 32-bit word and the best groups in another
ROUTER_MAX_EXPERTS = 32 * 32
ROUTER_MAX_GROUPS = 32
