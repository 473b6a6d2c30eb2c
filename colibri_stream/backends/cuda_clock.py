"""The step timer's clock on a GPU: phases measured on the stream's timeline with CUDA events, not on the host's.

Host time misplaces GPU work: kernels are queued ahead and run later, so a phase that queues work and returns
looks short, and the next phase that waits for the device (a copy of group sizes to the host, the logits)
absorbs everything still running. A CUDA event recorded on the current stream where a phase starts and ends
measures what the stream did between them.

`mark` records an event (reused from a pool) and returns it; `seconds` converts a finished step's events to
seconds on the `time.perf_counter` timeline, through an anchor: one event whose completion was observed at a known
host time. Inside a CUDA-graph capture an event would become part of the graph, so a mark there is the host's
time instead (such a phase is host-timed, as without this clock).
"""

from __future__ import annotations

import time
from typing import Any

from ..timing import Clock


class CudaEventClock(Clock):
    """Phase markers as CUDA events on the current stream (`timing.Clock`'s contract)."""

    track = "gpu"

    def __init__(self, cp):
        self._cp = cp
        self._free: list[Any] = []  # events whose step has been converted, for reuse
        self._anchor: tuple[Any, float] | None = None  # (event, the perf_counter time it completed at)

    def mark(self) -> Any:
        stream = self._cp.cuda.get_current_stream()
        if stream.is_capturing():
            return time.perf_counter()
        if self._anchor is None:
            anchor = self._cp.cuda.Event()
            anchor.record(stream)
            anchor.synchronize()
            self._anchor = (anchor, time.perf_counter())
        event = self._free.pop() if self._free else self._cp.cuda.Event()
        event.record(stream)
        return event

    def seconds(self, marks: list[Any]) -> list[float]:
        events = [mark for mark in marks if not isinstance(mark, float)]
        if not events:
            return marks
        for event in events:
            event.synchronize()
        anchor, at = self._anchor
        elapsed = self._cp.cuda.get_elapsed_time
        out = [mark if isinstance(mark, float) else at + elapsed(anchor, mark) / 1e3 for mark in marks]
        self._free.extend(events)
        return out
