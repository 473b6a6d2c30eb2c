"""A host thread that computes one MoE layer's CPU experts in one compiled call, handed its work without the GIL.

The GPU slot store (gpu_tier.py) hands the experts it places on the CPU to another thread once per MoE layer.
Through a Python thread pool that hand-off would wake a thread and pass it the GIL, and run Python around the
executor's kernel, every layer (benchmarks/offload_timeline.py times both). Here the thread waits inside a compiled
loop that holds no GIL: it spins on a doorbell word, reads the job from a table of
int64 words (the addresses of the layer's tokens, routing, output and of each expert's pinned block, and the row
range the CPU computes), runs the executor's kernel (cpu_executor.expert_kernel) for each expert over the tokens
routed to it, adds the result times the routing weight into the output, then raises the CUDA stream's flag
(handoff.HostFlag) and the done word, waking the thread that waits for it (a futex on Linux). After SPIN_SECONDS
with no job it leaves the loop and sleeps on a threading.Event, so an idle server does not keep a core busy.

`CpuLayerWorker.serves(executor, tensors)` says whether a worker over that executor's kernel computes experts like
`tensors` (else the caller runs the executor expert by expert). Blocks must be in host memory for the whole job:
the caller keeps them (and the arrays it passes) alive until `wait` returns.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import threading
import weakref

import numpy as np

from .cpu_executor import KERNEL_DTYPES, CpuExpertExecutor, expert_kernel, numba

SPIN_SECONDS = 0.005  # the worker spins this long after a job before it sleeps (a decode step's layers are closer)
WAIT_SPINS = 2000  # `wait` checks this often (or for CpuLayerWorker.wait_spin_seconds) before it sleeps
WAIT_SPIN_SECONDS = 0.05  # `wait` spins this long at most where the job's threads leave it a core
WAIT_SLEEP_US = 20  # without futexes (not Linux on x86-64 or arm64): `wait` sleeps this long between checks
# Linux futex system call numbers; the waiter sleeps on the low half of the DONE word until the worker wakes it
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine()) if sys.platform == "linux" else None
FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 128, 129
HEADER = 9  # job words: tokens, top_k, x, ids, weights, out addresses, flag address, flag value, experts
ITEM = 4  # words per expert: block address, first row, last row, expert id
WEIGHT_NAMES = ("gate", "up", "down", "gate_scale", "up_scale", "down_scale")
# control words: the latest ticket handed over, the latest finished, stop, the job table's address, the latest
# job's start and end (CLOCK_MONOTONIC ns)
DOORBELL, DONE, STOP, JOBS, START_NS, END_NS = range(6)


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    _libc = ctypes.CDLL(None)
    _clock_gettime = _libc.clock_gettime
    _clock_gettime.argtypes = [ctypes.c_int, ctypes.c_void_p]
    _clock_gettime.restype = ctypes.c_int
    _usleep = _libc.usleep
    _usleep.argtypes = [ctypes.c_uint]
    _usleep.restype = ctypes.c_int
    _syscall = _libc.syscall
    _syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_int]
    _syscall.restype = ctypes.c_long
    CLOCK_MONOTONIC = 1
    FUTEX = SYS_FUTEX if SYS_FUTEX is not None else -1

    @intrinsic
    def _pointer(typingctx, address):
        """An integer address as a void pointer (for numba.carray)."""
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], cgutils.voidptr_t)

        return types.voidptr(address), codegen

    @intrinsic
    def _load_acquire(typingctx, address):
        """The int64 at `address`, read anew every time (an atomic load): a word another thread writes."""
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.load_atomic(builder.inttoptr(args[0], ir.IntType(64).as_pointer()), "acquire", 8)

        return types.int64(address), codegen

    def _release_store(bits: int):
        @intrinsic
        def store(typingctx, address, value):
            """Store `value` at `address` after every earlier write (an atomic release store)."""
            if not isinstance(address, types.Integer) or not isinstance(value, types.Integer):
                return None

            def codegen(context, builder, signature, args):
                word = ir.IntType(bits)
                value = builder.trunc(args[1], word) if bits < 64 else args[1]
                builder.store_atomic(value, builder.inttoptr(args[0], word.as_pointer()), "release", bits // 8)
                return context.get_dummy_value()

            return types.void(address, value), codegen

        return store

    _store_release = _release_store(64)
    _store_release32 = _release_store(32)

    @numba.njit(nogil=True)
    def _now_ns() -> int:
        spec = np.empty(2, np.int64)  # struct timespec: seconds, nanoseconds
        _clock_gettime(CLOCK_MONOTONIC, _pointer(spec.ctypes.data))
        return spec[0] * 1_000_000_000 + spec[1]

    @numba.njit(nogil=True)
    def ring(control: int, ticket: int) -> None:
        """Hand the job in the table to the worker as `ticket` (after every write to the table)."""
        _store_release(control + 8 * DOORBELL, ticket)

    @numba.njit(nogil=True)
    def notify_done(control: int, ticket: int) -> None:
        """Mark `ticket` finished (after every write of the job) and wake a thread waiting for it."""
        _store_release(control + 8 * DONE, ticket)
        if FUTEX >= 0:
            _syscall(FUTEX, _pointer(control + 8 * DONE), FUTEX_WAKE_PRIVATE, 1 << 30, _pointer(0), _pointer(0), 0)

    @numba.njit(nogil=True)
    def wait_done(control: int, ticket: int, spin_ns: int) -> None:
        """Wait, without the GIL, until the worker has finished `ticket`: a spin (WAIT_SPINS checks, or spin_ns
        if longer), then asleep until the worker wakes this thread (a futex on the DONE word's low half), or sleeps of
        WAIT_SLEEP_US without futexes. Spin for a whole job only where its threads leave the waiter a core: a waiter
        beside threads on every core takes one of theirs, and its short sleeps then slow the job down."""
        for _ in range(WAIT_SPINS):
            if _load_acquire(control + 8 * DONE) >= ticket:
                return
        if spin_ns > 0:
            until = _now_ns() + spin_ns
            while _now_ns() < until:
                if _load_acquire(control + 8 * DONE) >= ticket:
                    return
        while True:
            done = _load_acquire(control + 8 * DONE)
            if done >= ticket:
                return
            if FUTEX >= 0:  # returns at once if the word is no longer `done` (no wake-up is lost)
                _syscall(FUTEX, _pointer(control + 8 * DONE), FUTEX_WAIT_PRIVATE, np.int32(done & 0xFFFFFFFF),
                         _pointer(0), _pointer(0), 0)
            else:
                _usleep(WAIT_SLEEP_US)


_servers: dict = {}


def _server(dtype: np.dtype, scaled: bool):
    """The worker's compiled loop for experts of `dtype` (with int8's row scales when `scaled`), built once."""
    key = (dtype.str, scaled)
    if key in _servers:
        return _servers[key]

    @numba.njit(nogil=True)
    def serve(control: int, layout: np.ndarray, spin_ns: int, threads: int) -> None:
        """Run jobs until STOP is set or no job came for spin_ns. layout: offsets of gate, up, down and the three
        scales in a block, then I and H."""
        inter, hidden = layout[6], layout[7]
        numba.set_num_threads(threads)
        idle_since = _now_ns()
        while True:
            ticket = _load_acquire(control + 8 * DOORBELL)
            if ticket == _load_acquire(control + 8 * DONE):
                if _load_acquire(control + 8 * STOP) != 0 or _now_ns() - idle_since > spin_ns:
                    return
                continue
            start = _now_ns()
            header = numba.carray(_pointer(_load_acquire(control + 8 * JOBS)), (HEADER,), np.int64)
            jobs = numba.carray(_pointer(_load_acquire(control + 8 * JOBS)), (HEADER + ITEM * header[8],), np.int64)
            tokens, top_k = jobs[0], jobs[1]
            x = numba.carray(_pointer(jobs[2]), (tokens, hidden), np.float32)  # [T, H]
            ids = numba.carray(_pointer(jobs[3]), (tokens, top_k), np.int64)  # [T, k]
            weights = numba.carray(_pointer(jobs[4]), (tokens, top_k), np.float32)  # [T, k]
            out = numba.carray(_pointer(jobs[5]), (tokens, hidden), np.float32)  # [T, H]
            out[:] = 0.0
            for item in range(jobs[8]):
                at = HEADER + ITEM * item
                block, first, last, expert = jobs[at], jobs[at + 1], jobs[at + 2], jobs[at + 3]
                gate = numba.carray(_pointer(block + layout[0]), (inter, hidden), dtype)  # [I, H]
                up = numba.carray(_pointer(block + layout[1]), (inter, hidden), dtype)  # [I, H]
                down = numba.carray(_pointer(block + layout[2]), (hidden, inter), dtype)  # [H, I]
                if scaled:
                    gate_scale = numba.carray(_pointer(block + layout[3]), (inter,), np.float32)
                    up_scale = numba.carray(_pointer(block + layout[4]), (inter,), np.float32)
                    down_scale = numba.carray(_pointer(block + layout[5]), (hidden,), np.float32)
                else:
                    gate_scale = up_scale = down_scale = np.empty(0, np.float32)
                routed = np.empty(tokens, np.int64)  # the tokens routed to this expert
                scale = np.empty(tokens, np.float32)  # and their routing weights
                n = 0
                for t in range(tokens):
                    for j in range(top_k):
                        if ids[t, j] == expert:
                            routed[n], scale[n] = t, weights[t, j]
                            n += 1
                if n == 0:
                    continue
                rows = np.empty((n, hidden), np.float32)  # [n, H]
                for r in range(n):
                    rows[r] = x[routed[r]]
                h = np.empty((n, last - first), np.float32)  # [n, last - first]
                y = np.empty((n, hidden), np.float32)  # [n, H]
                expert_kernel(gate, up, down, gate_scale, up_scale, down_scale, rows, first, last, h, y, threads)
                for r in range(n):
                    for c in range(hidden):
                        out[routed[r], c] += y[r, c] * scale[r]
            _store_release(control + 8 * START_NS, start)
            _store_release(control + 8 * END_NS, _now_ns())
            if jobs[6] != 0:
                _store_release32(jobs[6], jobs[7])  # the stream waiting on this flag may go on
            notify_done(control, ticket)
            idle_since = _now_ns()

    _servers[key] = serve
    return serve


class _Shared:
    """What a CpuLayerWorker and its thread share: the thread holds this, not the worker, so a worker nobody uses
    any more is collected and its finalizer stops the thread."""

    def __init__(self, serve, layout: np.ndarray, threads: int):
        self.serve, self.layout, self.threads = serve, layout, threads
        self.control = np.zeros(8, np.int64)
        self.jobs = np.zeros(HEADER, np.int64)  # the latest job table (grown as needed)
        self.error: Exception | None = None
        self.serving = False  # the thread is in the compiled loop (or about to enter it)
        self.entered = threading.Event()
        self.wake = threading.Event()

    def stop(self) -> None:
        self.control[STOP] = 1
        self.wake.set()


def _run(shared: _Shared) -> None:
    """The worker thread: sleep until woken, then the compiled loop until it is idle for SPIN_SECONDS."""
    spin_ns, control = int(SPIN_SECONDS * 1e9), shared.control
    while True:
        shared.wake.wait()
        shared.wake.clear()
        if control[STOP]:
            return
        shared.serving = True
        shared.entered.set()
        try:
            shared.serve(control.ctypes.data, shared.layout, spin_ns, shared.threads)
        except Exception as error:  # the job ends anyway: nobody may wait for it forever
            shared.error = error
            jobs = shared.jobs
            control[START_NS] = control[END_NS] = 0
            if jobs[6] != 0:
                ctypes.c_uint32.from_address(int(jobs[6])).value = int(jobs[7])
            notify_done(control.ctypes.data, int(control[DOORBELL]))
        finally:
            shared.serving = False


class CpuLayerWorker:
    """One host thread computing a layer's CPU experts per `submit`, in one compiled call; see the module docstring.

    tensors: one expert's tensors as `ExpertFile.unpack` gives them from `block` (their offsets in a block and
    shapes are the same for every block). threads: the kernel's threads. `expert_bytes`: the weight bytes of one
    expert. `wait` returns a job's seconds; counting them is the caller's. The thread stops with `close` or when
    the worker is collected.
    """

    def __init__(self, tensors: dict[str, np.ndarray], block: np.ndarray, threads: int):
        if numba is None or tensors["gate"].dtype not in KERNEL_DTYPES:
            raise ValueError("the CPU expert kernel does not serve these experts (numba is missing or their dtype)")
        base = block.ctypes.data
        offsets = [tensors[name].ctypes.data - base if name in tensors else -1 for name in WEIGHT_NAMES]
        inter, hidden = tensors["gate"].shape
        dtype = np.dtype(np.uint16) if tensors["gate"].dtype == KERNEL_DTYPES[0] else tensors["gate"].dtype
        self.threads = threads
        # How long `wait` spins before it sleeps (0: WAIT_SPINS checks): through a whole job where its threads leave
        # the waiter a core, as `threads_beside_gpu` does: a spinning waiter sees the job's end sooner than one woken
        # by the futex (benchmarks/offload_timeline.py --waiters spin sleep).
        self.wait_spin_seconds = WAIT_SPIN_SECONDS if threads < numba.config.NUMBA_NUM_THREADS else 0.0
        self.expert_bytes = sum(t.nbytes for t in tensors.values())
        self._shared = _Shared(_server(dtype, "gate_scale" in tensors),
                               np.array([*offsets, inter, hidden], np.int64), threads)
        self._ticket = 0
        self._held: tuple = ()  # what the job not yet waited for reads: kept alive until `wait`
        self._thread = threading.Thread(target=_run, args=(self._shared,), name="colibri-cpu-experts", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._shared.stop)
        empty = np.zeros((0, hidden), np.float32)  # compiles the loop now, not in the first step
        self.wait(self.submit([], np.zeros((0, 1), np.int64), empty, np.zeros((0, 1), np.float32), empty.copy()))

    @staticmethod
    def serves(executor: CpuExpertExecutor | None, tensors: dict[str, np.ndarray]) -> bool:
        """Whether a worker over `executor`'s kernel computes experts like `tensors`: the kernel is there (numba),
        takes their dtype, and the executor would use it for their size (min_kernel_bytes)."""
        return (executor is not None and executor.kernel is not None and tensors["gate"].dtype in KERNEL_DTYPES
                and sum(t.nbytes for t in tensors.values()) >= executor.min_kernel_bytes)

    def submit(self, items: list[tuple[int, int, int, int]], ids: np.ndarray, x: np.ndarray, weights: np.ndarray,
               out: np.ndarray, flag_address: int = 0, flag_value: int = 0) -> int:
        """Start the layer's job: for each (block address, first row, last row, expert id), the expert's part over
        intermediate rows first .. last - 1 for the tokens `ids` routes to it, weighted, summed into `out`; then
        the uint32 at `flag_address` (if any) set to `flag_value`. Returns the job's ticket for `wait`.
        ids [T, k] int64, x [T, H] float32, weights [T, k] float32, out [T, H] float32, all C-contiguous."""
        if self._held:
            raise RuntimeError("the previous CPU expert job has not been waited for")
        ids = np.ascontiguousarray(ids, np.int64)
        x = np.ascontiguousarray(x, np.float32)
        weights = np.ascontiguousarray(weights, np.float32)
        if not out.flags.c_contiguous or out.dtype != np.float32 or out.shape != x.shape:
            raise ValueError(f"out must be C-contiguous float32 of shape {x.shape}")
        shared = self._shared
        words = HEADER + ITEM * len(items)
        if shared.jobs.size < words:
            shared.jobs = np.zeros(2 * words, np.int64)
        jobs = shared.jobs
        jobs[:HEADER] = (x.shape[0], ids.shape[1], x.ctypes.data, ids.ctypes.data, weights.ctypes.data,
                         out.ctypes.data, flag_address, flag_value, len(items))
        if items:
            jobs[HEADER:words] = np.asarray(items, np.int64).reshape(-1)
        self._held = (ids, x, weights, out, jobs)
        shared.control[JOBS] = jobs.ctypes.data  # a grown table is another array
        self._ticket += 1
        asleep = not shared.serving
        if asleep:
            shared.entered.clear()
        ring(shared.control.ctypes.data, self._ticket)  # after every write above
        shared.wake.set()
        if asleep:  # it needs the GIL to get back into its loop: let it have it now, not when this thread blocks
            shared.entered.wait()
        return self._ticket

    def wait(self, ticket: int) -> float:
        """Wait for job `ticket` (spinning briefly, then sleeping, without the GIL) and return its seconds; raises
        the worker's error."""
        shared = self._shared
        wait_done(shared.control.ctypes.data, ticket, int(self.wait_spin_seconds * 1e9))
        self._held = ()
        error, shared.error = shared.error, None
        if error is not None:
            raise RuntimeError("the CPU expert worker failed") from error
        return (shared.control[END_NS] - shared.control[START_NS]) / 1e9

    def span(self) -> tuple[float, float]:
        """(start, end) of the latest finished job in seconds of CLOCK_MONOTONIC, time.perf_counter's clock on
        Linux (benchmarks/offload_timeline.py)."""
        control = self._shared.control
        return control[START_NS] / 1e9, control[END_NS] / 1e9

    def close(self) -> None:
        self._shared.stop()
        self._thread.join()
