"""Does the page size of host memory change what the CPU expert executor and pinned copies read?

The L2 tier is pinned memory from cudaHostAlloc (`pinned_empty`). This allocates Mixtral-8x7B-shaped expert blocks
(bf16, 352 MB, random bits) three ways and measures, on each, the executor at one token (blocks in rotation, so no
block is in the CPU's caches) and host -> GPU copies:
  cuda_host_alloc   cupyx.empty_pinned (the driver's pages)
  thp_registered    anonymous mmap with MADV_HUGEPAGE (2 MiB transparent huge pages), then cudaHostRegister
  pageable          numpy.empty (the system's THP policy decides; copies from it are not asynchronous)
and prints the kernel's THP settings and how much of each region is backed by huge pages.

    python benchmarks/host_pages.py --out benchmarks/results/host_pages_h200.json
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from conditions import require_gpu
from decode import log, machine
from offload import write

from colibri_stream.experts.cpu_executor import CpuExpertExecutor

HIDDEN, INTER = 4096, 14336  # Mixtral-8x7B's expert
BLOCK = 3 * HIDDEN * INTER * 2  # bytes of one bf16 expert


def thp_settings() -> dict[str, str]:
    out = {}
    for name in ("enabled", "defrag"):
        path = Path("/sys/kernel/mm/transparent_hugepage") / name
        out[name] = path.read_text().strip() if path.exists() else "n/a"
    return out


def huge_bytes(address: int, size: int) -> int:
    """Bytes of [address, address + size) backed by anonymous huge pages (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start < address + size and end > address
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def random_block(rng: np.random.Generator) -> np.ndarray:
    """[BLOCK] uint8: random bf16 weights of a trained model's size (|w| ~ 0.02), never zeros."""
    values = (rng.standard_normal(BLOCK // 2, np.float32) * 0.02).view(np.uint32) >> 16
    return values.astype(np.uint16).view(np.uint8)


def allocate(kind: str, count: int):
    """([count, BLOCK] uint8, whether pinned, what to keep alive)."""
    import cupyx

    if kind == "cuda_host_alloc":
        blocks = cupyx.empty_pinned((count, BLOCK), np.uint8)
        return blocks, True, None
    if kind == "thp_registered":
        region = mmap.mmap(-1, count * BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        blocks = np.frombuffer(region, np.uint8).reshape(count, BLOCK)
        blocks[:, ::4096] = 1  # touch: pages are allocated (huge where possible) before they are pinned
        return blocks, False, region
    blocks = np.empty((count, BLOCK), np.uint8)
    blocks[:, ::4096] = 1
    return blocks, False, None


def tensors(block: np.ndarray) -> dict[str, np.ndarray]:
    words = block.view(np.uint16)
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    size = HIDDEN * INTER
    return {"gate": words[:size].view(bf16).reshape(INTER, HIDDEN),
            "up": words[size: 2 * size].view(bf16).reshape(INTER, HIDDEN),
            "down": words[2 * size: 3 * size].view(bf16).reshape(HIDDEN, INTER)}


def executor_rate(executor: CpuExpertExecutor, blocks: np.ndarray, rounds: int) -> float:
    x = np.random.default_rng(1).standard_normal((1, HIDDEN), np.float32)
    views = [tensors(b) for b in blocks]
    executor.run(x, views[0])
    times = []
    for _ in range(rounds):
        for view in views:
            begin = time.perf_counter()
            executor.run(x, view)
            times.append(time.perf_counter() - begin)
    return BLOCK / statistics.median(times)


def copy_rate(blocks: np.ndarray, rounds: int) -> float:
    import cupy as cp

    device = cp.empty(BLOCK, np.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    cp.cuda.runtime.memcpyAsync(device.data.ptr, blocks[0].ctypes.data, BLOCK, cp.cuda.runtime.memcpyHostToDevice,
                                stream.ptr)
    start.record(stream)
    for _ in range(rounds):
        for block in blocks:
            cp.cuda.runtime.memcpyAsync(device.data.ptr, block.ctypes.data, BLOCK,
                                        cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
    end.record(stream)
    end.synchronize()
    return rounds * len(blocks) * BLOCK / (cp.cuda.get_elapsed_time(start, end) / 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--kinds", nargs="+", default=["cuda_host_alloc", "thp_registered", "pageable"])
    parser.add_argument("--out", default="benchmarks/results/host_pages_h200.json")
    args = parser.parse_args(argv)
    require_gpu()
    import cupy as cp
    template = random_block(np.random.default_rng(0))  # copied into every block: each is its own memory
    executor = CpuExpertExecutor()
    settings = thp_settings()
    log(f"THP {settings}; executor threads {executor.num_threads}")
    records = []
    for kind in args.kinds:
        blocks, pinned, keep = allocate(kind, args.blocks)
        blocks[:] = template
        if kind == "thp_registered":
            cp.cuda.runtime.hostRegister(blocks.ctypes.data, blocks.nbytes, 0)
            pinned = True
        huge = huge_bytes(blocks.ctypes.data, blocks.nbytes)
        cpu = executor_rate(executor, blocks, args.rounds)
        h2d = copy_rate(blocks, 1 if not pinned else args.rounds)
        log(f"{kind:16s} huge pages {huge / blocks.nbytes:6.1%}  executor {cpu / 1e9:6.1f} GB/s  "
            f"host->GPU {h2d / 1e9:5.1f} GB/s")
        records.append(dict(machine(), commit=os.environ.get("COLIBRI_COMMIT", "unknown"), command=" ".join(sys.argv),
                            bench="host_pages", memory=kind, thp=settings, block_bytes=BLOCK, blocks=args.blocks,
                            figures={"huge_page_share": huge / blocks.nbytes, "executor_gbps": cpu / 1e9,
                                     "h2d_gbps": h2d / 1e9, "executor_threads": executor.num_threads}))
        write(args.out, records)
        if kind == "thp_registered":
            cp.cuda.runtime.hostUnregister(blocks.ctypes.data)
        del blocks, keep
    return 0


if __name__ == "__main__":
    sys.exit(main())
