"""A host thread that computes one MoE layer's CPU experts in one compiled call, handed its work without the GIL.

The GPU slot store (gpu_tier.py) hands the experts it places on the CPU to another thread once per MoE layer.
Through a Python thread pool that hand-off would wake a thread and pass it the GIL, and run Python around the
executor's kernel, every layer (benchmarks/offload_timeline.py times both). Here the thread waits inside a compiled
loop that holds no GIL: it spins on a doorbell word, reads the job from a table of
int64 words (the addresses of the layer's tokens, routing, output and of each expert's pinned block, and the row
range the CPU computes), runs the executor's kernel (cpu_executor.expert_kernel, or cpu_grouped's for the formats
with group scales) for each expert over the tokens routed to it, with the experts' biases and gated activation where
they have them (gpt-oss), adds the result times the routing weight into the output, then raises the CUDA stream's
flag (handoff.HostFlag) and the done word, waking the thread that waits for it (a futex on Linux). After
SPIN_SECONDS with no job it leaves the loop and sleeps on a threading.Event, so an idle server does not keep a core
busy.

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

from ..expert_codecs import EXPERT_BIASES, WEIGHT_TENSORS, codec_of
from .cpu_executor import KERNEL_DTYPES, CpuExpertExecutor, expert_bytes, expert_kernel, numba
from .cpu_grouped import MXFP4, grouped_expert_kernel, kernel_arguments
from .jit import SILU

SPIN_SECONDS = 0.005  # the worker spins this long after a job before it sleeps (a decode step's layers are closer)
WAIT_SPINS = 2000  # `wait` checks this often (or for CpuLayerWorker.wait_spin_seconds) before it sleeps
WAIT_SPIN_SECONDS = 0.05  # `wait` spins this long at most where the job's threads leave it a core
WAIT_SLEEP_US = 20  # without futexes (not Linux on x86-64 or arm64): `wait` sleeps this long between checks
# Linux futex system call numbers; the waiter sleeps on the low half of the DONE word until the worker wakes it
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine()) if sys.platform == "linux" else None
FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 128, 129
HEADER = 9  # job words: tokens, top_k, x, ids, weights, out addresses, flag address, flag value, experts
ITEM = 4  # words per expert: block address, first row, last row, expert id
# A block's tensors in the layout table: per name its offset in the block (-1: absent) and two dimensions
LAYOUT_WORDS = 3 * len(WEIGHT_TENSORS)  # then I, H, and the grouped kernel's rows and columns per scale of each matrix
BIAS_WORDS = LAYOUT_WORDS + 8  # then the offsets of gate_bias, up_bias, down_bias (-1: the experts have none)
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

    @numba.njit(nogil=True)
    def _biases(block, layout, inter):
        """The block's gate and up biases ([I] float32 each), or empty arrays for experts without them."""
        if layout[BIAS_WORDS] < 0:
            return np.empty(0, np.float32), np.empty(0, np.float32)
        return (numba.carray(_pointer(block + layout[BIAS_WORDS]), (inter,), np.float32),
                numba.carray(_pointer(block + layout[BIAS_WORDS + 1]), (inter,), np.float32))

    @numba.njit(nogil=True)
    def _add_down_bias(block, layout, first, y):
        """y [n, H] += the block's down bias where the experts have one and this part holds intermediate row 0 (the
        part that adds it once: experts with biases are never cut, so it is the whole expert)."""
        if layout[BIAS_WORDS + 2] < 0 or first != 0:
            return
        down_bias = numba.carray(_pointer(block + layout[BIAS_WORDS + 2]), (y.shape[1],), np.float32)  # [H]
        for r in range(y.shape[0]):
            for c in range(y.shape[1]):
                y[r, c] += down_bias[c]


_servers: dict = {}


def _plain_compute(dtype: np.dtype, scaled: bool):
    """The worker's call of cpu_executor.expert_kernel on one block of `dtype` weights (with int8's row scales
    when `scaled`)."""
    @numba.njit(nogil=True)
    def compute(block, layout, activation, rows, first, last, h, y, threads):
        gate = numba.carray(_pointer(block + layout[0]), (layout[1], layout[2]), dtype)  # [I, H]
        up = numba.carray(_pointer(block + layout[3]), (layout[4], layout[5]), dtype)  # [I, H]
        down = numba.carray(_pointer(block + layout[6]), (layout[7], layout[8]), dtype)  # [H, I]
        if scaled:
            gate_scale = numba.carray(_pointer(block + layout[9]), (layout[10],), np.float32)  # [I]
            up_scale = numba.carray(_pointer(block + layout[12]), (layout[13],), np.float32)  # [I]
            down_scale = numba.carray(_pointer(block + layout[15]), (layout[16],), np.float32)  # [H]
        else:
            gate_scale = up_scale = down_scale = np.empty(0, np.float32)
        gate_bias, up_bias = _biases(block, layout, layout[1])
        expert_kernel(gate, up, down, gate_scale, up_scale, down_scale, gate_bias, up_bias, activation, rows, first,
                      last, h, y, threads)
        _add_down_bias(block, layout, first, y)

    return compute


def _grouped_compute(kind: int, zeroed: bool):
    """The worker's call of cpu_grouped.grouped_expert_kernel on one int4, fp8 or mxfp4 block (`kind`; with zero
    points when `zeroed`). Scales are float32, mxfp4's e8m0 exponent bytes."""
    scale_dtype = np.uint8 if kind == MXFP4 else np.float32

    @numba.njit(nogil=True)
    def compute(block, layout, activation, rows, first, last, h, y, threads):
        at = LAYOUT_WORDS + 2
        gate = numba.carray(_pointer(block + layout[0]), (layout[1], layout[2]), np.uint8)  # [I, bytes per row]
        up = numba.carray(_pointer(block + layout[3]), (layout[4], layout[5]), np.uint8)  # [I, bytes per row]
        down = numba.carray(_pointer(block + layout[6]), (layout[7], layout[8]), np.uint8)  # [H, bytes per row]
        gate_scale = numba.carray(_pointer(block + layout[9]), (layout[10], layout[11]), scale_dtype)
        up_scale = numba.carray(_pointer(block + layout[12]), (layout[13], layout[14]), scale_dtype)
        down_scale = numba.carray(_pointer(block + layout[15]), (layout[16], layout[17]), scale_dtype)
        if zeroed:
            gate_zero = numba.carray(_pointer(block + layout[18]), (layout[19], layout[20]), np.uint8)
            up_zero = numba.carray(_pointer(block + layout[21]), (layout[22], layout[23]), np.uint8)
            down_zero = numba.carray(_pointer(block + layout[24]), (layout[25], layout[26]), np.uint8)
        else:
            gate_zero = up_zero = down_zero = np.zeros((0, 0), np.uint8)
        gate_bias, up_bias = _biases(block, layout, layout[LAYOUT_WORDS])
        grouped_expert_kernel(kind, gate, gate_scale, gate_zero, layout[at], layout[at + 1], up, up_scale, up_zero,
                              layout[at + 2], layout[at + 3], down, down_scale, down_zero, layout[at + 4],
                              layout[at + 5], gate_bias, up_bias, activation, rows, first, last, h, y, threads)
        _add_down_bias(block, layout, first, y)

    return compute


def _server(key: tuple, make_compute):
    """The worker's compiled loop over `make_compute()` (one expert block's part: _plain_compute or
    _grouped_compute), built once per `key`."""
    if key in _servers:
        return _servers[key]
    compute = make_compute()

    @numba.njit(nogil=True)
    def serve(control: int, layout: np.ndarray, gating: np.ndarray, spin_ns: int, threads: int) -> None:
        """Run jobs until STOP is set or no job came for spin_ns. layout: see LAYOUT_WORDS; gating [3] float32: the
        experts' activation (jit.SILU's form: limit, alpha, up_shift)."""
        hidden = layout[LAYOUT_WORDS + 1]
        activation = (gating[0], gating[1], gating[2])
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
                compute(block, layout, activation, rows, first, last, h, y, threads)
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

    def __init__(self, serve, layout: np.ndarray, gating: np.ndarray, threads: int):
        self.serve, self.layout, self.gating, self.threads = serve, layout, gating, threads
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
            shared.serve(control.ctypes.data, shared.layout, shared.gating, spin_ns, shared.threads)
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
    shapes are the same for every block; biases where the experts have them). threads: the kernel's threads.
    activation: the experts' gated activation (jit.SILU, or jit.activation_of a clamped SwiGLU). `expert_bytes`: the
    weight bytes of one expert. `wait` returns a job's seconds; counting them is the caller's. The thread stops with
    `close` or when the worker is collected.
    """

    def __init__(self, tensors: dict[str, np.ndarray], block: np.ndarray, threads: int, activation: tuple = SILU):
        codec = codec_of(tensors)
        if numba is None or codec.cpu_kernel is None or (codec.cpu_kernel == "plain"
                                                         and tensors["gate"].dtype not in KERNEL_DTYPES):
            raise ValueError("the CPU expert kernel does not serve these experts (numba is missing or their format)")
        inter, hidden = tensors["gate"].shape[0], tensors["down"].shape[0]
        if codec.cpu_kernel == "grouped":
            arguments = kernel_arguments(codec, tensors)  # kind, then (bytes, scale, zero, rows, cols) per matrix
            arrays = {name: arguments[1 + 5 * m + k] for m, matrix in enumerate(("gate", "up", "down"))
                      for k, name in enumerate((matrix, matrix + "_scale", matrix + "_zero"))}
            per_scale = [arguments[1 + 5 * m + k] for m in range(3) for k in (3, 4)]
            kind, zeroed = arguments[0], "gate_zero" in tensors
            key, make_compute = ("grouped", kind, zeroed), lambda: _grouped_compute(kind, zeroed)
        else:
            arrays, per_scale = tensors, [0] * 6
            dtype = np.dtype(np.uint16) if tensors["gate"].dtype == KERNEL_DTYPES[0] else tensors["gate"].dtype
            scaled = "gate_scale" in tensors
            key, make_compute = ("plain", dtype.str, scaled), lambda: _plain_compute(dtype, scaled)
        base, layout = block.ctypes.data, []
        for name in WEIGHT_TENSORS:
            array = arrays.get(name)
            present = array is not None and array.size > 0
            layout += [array.ctypes.data - base, *array.shape, *([0] * (2 - array.ndim))] if present else [-1, 0, 0]
        biases = [tensors[name].ctypes.data - base if name in tensors else -1 for name in EXPERT_BIASES]
        self.threads = threads
        # How long `wait` spins before it sleeps (0: WAIT_SPINS checks): through a whole job where its threads leave
        # the waiter a core, as `threads_beside_gpu` does: a spinning waiter sees the job's end sooner than one woken
        # by the futex (benchmarks/offload_timeline.py --waiters spin sleep).
        self.wait_spin_seconds = WAIT_SPIN_SECONDS if threads < numba.config.NUMBA_NUM_THREADS else 0.0
        self.expert_bytes = expert_bytes(tensors, 0, inter)
        self._shared = _Shared(_server(key, make_compute),
                               np.array([*layout, inter, hidden, *per_scale, *biases], np.int64),
                               np.array(activation, np.float32), threads)
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
        return executor is not None and executor.computes(codec_of(tensors), tensors["gate"].dtype,
                                                          sum(t.nbytes for t in tensors.values()))

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
