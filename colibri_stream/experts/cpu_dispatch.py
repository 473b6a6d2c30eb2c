"""The CPU's part of a GPU-tier layer: handed to a compiled worker or a Python thread, its end taken in later.

`start(plan)` hands the experts a LayerPlan places on the CPU (whole, and a cut one's rows past the GPU's) to the
`CpuLayerWorker` (every block in host memory and its kernel serving them: one compiled call, which raises the
flag itself) or else to the CPU thread, which runs the executor expert by expert and raises the flag after. The
weighted sum lands in one pinned buffer; the compute stream waits on the flag (handoff.HostFlag), not the host.
`collect()` waits for the latest job's end and returns its seconds, raising its error.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..checkpoint import ExpertFile
from .block_sources import BlockSource
from .cpu_executor import CpuExpertExecutor
from .cpu_worker import CpuLayerWorker
from .handoff import HostFlag
from .jit import activation_of
from .pinned import pinned_empty
from .step_plan import CpuJob, LayerPlan

logger = logging.getLogger(__name__)


class CpuDispatch:
    """Runs the CPU's part of GPU-tier layers, one layer at a time, beside the step thread (see the module
    docstring). `pending` is the plan whose CPU work has not been taken in yet."""

    def __init__(self, expert_file: ExpertFile, source: BlockSource, executor: CpuExpertExecutor, stream,
                 layout_layer: int):
        self.file, self.source, self.executor = expert_file, source, executor
        self.swiglu = expert_file.config.clamped_swiglu()  # the experts' activation when not silu(gate) * up
        self.flag = HostFlag.create(stream)
        self.worker = self._make_worker(layout_layer)  # the CPU's part in one compiled call a layer, where it serves
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="colibri-cpu-experts")  # runs the executor
        self._out: np.ndarray | None = None  # float32, pinned, grown as needed
        self.pending: LayerPlan | None = None

    def _make_worker(self, layer: int) -> CpuLayerWorker | None:
        """A CpuLayerWorker when the executor's kernel serves these experts and the CPU reads host blocks (else the
        CPU thread's Python runs the executor expert by expert)."""
        block = self.source.layout_block(layer)  # tensor offsets from one block
        if block is None:
            return None
        tensors = self.file.unpack(block)
        if not CpuLayerWorker.serves(self.executor, tensors):
            return None
        logger.info("CPU experts: one compiled call per layer on %d threads (CpuLayerWorker)",
                    self.executor.num_threads)
        return CpuLayerWorker(tensors, block, self.executor.num_threads, activation_of(self.swiglu))

    def start(self, plan: LayerPlan) -> CpuJob | None:
        """Hand the plan's CPU work over (None: it has none), so it is computed while the step thread queues the
        layer's copies and kernels. Blocks in host memory are looked up here (the sources are used from the step
        thread only); one in none is read from experts.bin by the CPU thread."""
        work = plan.cpu_work(self.file.config.moe_intermediate_size)
        if not work:
            plan.cpu = None
            return None
        x = plan.x
        # One output buffer serves every layer: the next layer's work is handed over after begin_layer has
        # synchronised the stream, which by then has copied this one out.
        if self._out is None or self._out.size < x.size:
            self._out = pinned_empty(1, 2 * x.nbytes)[0].view(np.float32)
        job = plan.cpu = CpuJob(work, self._out[: x.size].reshape(x.shape), self.flag.ticket())  # out [T, H]
        in_memory = all(self.source.in_memory(plan.layer, expert) for expert, _ in work)
        if self.worker is not None and in_memory:
            self._start_worker_job(plan, job)
        else:
            self._start_thread(plan, job, in_memory)
        self.pending = plan  # taken in by the next begin_layer, even if this step fails before finish_layer
        return job

    def thread_job_pending(self) -> bool:
        """Whether the CPU thread (not the worker) still has a layer not taken in (its Python needs the GIL)."""
        return self.pending is not None and self.pending.cpu.worker_job is None

    def _start_thread(self, plan: LayerPlan, job: CpuJob, in_memory: bool) -> None:
        """Hand the layer's CPU work to the CPU thread, which runs the executor expert by expert."""
        fetches = []
        for expert, rows in job.work:
            if self.source.in_memory(plan.layer, expert):
                held = self.source.block(plan.layer, expert)
                fetches.append((expert, rows, lambda held=held: held))
            else:
                self.source.count_disk_read()
                fetches.append((expert, rows, lambda e=expert: self.source.read_staged(plan.layer, e)))
        entered = threading.Event()
        job.future = self._thread.submit(self._compute, plan.ids, plan.x, plan.weights, fetches, job.out, job.ticket,
                                         entered)
        # Let the CPU thread take the GIL for its Python before the executor (which runs without it): while this
        # thread queues kernels, the other would wait for the GIL. Not behind a disk read.
        if in_memory:
            entered.wait()

    def _start_worker_job(self, plan: LayerPlan, job: CpuJob) -> None:
        """Hand the layer's CPU work to the CpuLayerWorker: each block's address and row range; it raises the flag
        itself. The blocks are released when the work is taken in."""
        inter, items = self.file.config.moe_intermediate_size, []
        for expert, rows in job.work:
            block, release = self.source.block(plan.layer, expert)
            first, last = rows or (0, inter)
            items.append((block.ctypes.data, first, last, expert))
            job.releases.append(release)
        job.worker_job = self.worker.submit(items, plan.ids, plan.x, plan.weights, job.out,
                                            self.flag.word.ctypes.data, job.ticket)
        job.nbytes = sum((last - first) * self.worker.expert_bytes // inter for _, first, last, _ in items)

    def _compute(self, ids: np.ndarray, x: np.ndarray, weights: np.ndarray, fetches: list, out: np.ndarray,
                 ticket: int, entered: threading.Event) -> float:
        """On the CPU thread: the weighted sum of the fetched experts' outputs over their tokens into `out`, then
        the flag raised to `ticket` (also on an error: the stream waiting on it must go on; the step thread raises
        the error). `entered` is set as the executor is called. Returns the seconds it took.
        ids [T, k], x [T, H], weights [T, k] -> out [T, H]"""
        begin = time.perf_counter()
        try:
            out.fill(0.0)
            for expert, rows, fetch in fetches:
                tokens, which = np.nonzero(ids == expert)  # the tokens routed to it, and their top-k position
                block, release = fetch()
                try:
                    tensors, rows_x = self.file.unpack(block), x[tokens]
                    entered.set()
                    y = self.executor.run(rows_x, tensors, rows, self.swiglu)  # [n, H]
                finally:
                    release(None)
                out[tokens] += y * weights[tokens, which][:, None]  # a token routes to an expert at most once
            return time.perf_counter() - begin
        finally:
            entered.set()
            self.flag.set(ticket)

    def collect(self) -> tuple[LayerPlan, float] | None:
        """Wait for the latest layer's CPU work (its flag is set once it ends, so the stream waiting on it goes on):
        (its plan, the seconds it took), raising its error; None when nothing is pending."""
        plan, self.pending = self.pending, None
        if plan is None:
            return None
        job = plan.cpu
        if job.worker_job is not None:
            seconds = self.worker.wait(job.worker_job)
            for release in job.releases:
                release(None)
            self.executor.record(len(job.work), seconds, job.nbytes)
        else:
            seconds = job.future.result()
        return plan, seconds

    def close(self) -> None:
        """Join the CPU thread and the worker (it may still be spinning in compiled code)."""
        self._thread.shutdown(wait=True)
        if self.worker is not None:
            self.worker.close()
