"""Per-step timings: where one engine step spends its time, as nested named phases.

A step is a tree of phases with stable names (`PHASES`):

    step > schedule | prepare | forward | sample | update | detokenize
    forward > attention | routing | experts | mlp     (once per layer; a step's figure is their sum)

`StepTimer` records them while it has a sink (a callable that receives each finished `StepRecord`) and is
enabled; otherwise `phase()` returns a shared no-op context, so instrumented code costs one call per phase.
Host phases read `time.perf_counter`; the model's phases read the backend's `Clock`, which a GPU backend can
implement with CUDA events so that measuring never synchronizes the device. `ChromeTraceWriter` is a sink that
writes every phase as a Chrome-trace event (opens in ui.perfetto.dev and chrome://tracing), one track per clock
stream.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import orjson

# Every phase the engine records -> the phase it runs inside.
PHASES: dict[str, str | None] = {
    "step": None,
    "schedule": "step",  # the scheduler picks the step's sequences and token budget
    "prepare": "step",  # the flat batch (positions, slot mapping, block tables)
    "forward": "step",  # the model, logits copied to the host (a step launched ahead: the wait for its ids)
    "attention": "forward",  # projections, rotary, KV write, paged attention (all layers)
    "routing": "forward",  # router logits and top-k
    "experts": "forward",  # routed and shared expert compute
    "expert_load_disk": "experts",  # demand reads of expert blocks from experts.bin (tiered store, a miss)
    "expert_load_wait": "experts",  # waiting for a prefetched expert block still being read
    "expert_cpu": "experts",  # waiting for the experts the GPU tier placed on the CPU (computed on its CPU thread
    # from the layer's routing on, while the layer's copies and kernels are queued and run)
    "mlp": "forward",  # the dense MLP of non-MoE layers
    "sample": "step",  # the sampler
    "update": "step",  # the scheduler advances the sequences
    "detokenize": "step",  # incremental detokenization, stop strings, outputs
}


class Clock:
    """Where phases read the time: the host's `time.perf_counter`, one track named `track`.

    A backend whose work runs asynchronously (a GPU stream) subclasses it: `mark()` records a marker where a phase
    starts or ends (a CUDA event on the stream), and `seconds(marks)` converts a step's markers to seconds on the
    `time.perf_counter` timeline once the step is over (its copy of the logits to the host has synchronized).
    """

    track = "host"
    mark = staticmethod(time.perf_counter)  # -> a marker

    def seconds(self, marks: list[Any]) -> list[float]:
        return marks


HOST_CLOCK = Clock()


class Span(NamedTuple):
    """One phase of one step."""

    name: str
    track: str  # the clock's stream
    depth: int  # 0 for the step, 1 for its phases, 2 for the forward's parts
    start: float  # seconds on the time.perf_counter timeline
    end: float


# A closed phase: name, clock, depth, start and end marks (seconds once its step is over).
_Closed = tuple[str, Clock, int, Any, Any]


class StepRecord:
    """One finished step: its duration, its seconds per phase, and every phase as a `Span` (built when asked for)."""

    __slots__ = ("index", "args", "duration", "_closed")

    def __init__(self, index: int, closed: list[_Closed], args: dict[str, Any]):
        self.index = index  # steps recorded before this one
        self.args = args  # what the step annotated (tokens, sequences)
        self._closed = closed  # in closing order: the step last
        self.duration = closed[-1][4] - closed[-1][3]  # seconds

    @property
    def spans(self) -> list[Span]:
        """The step first, then its phases by start time."""
        spans = [Span(name, clock.track, depth, start, end) for name, clock, depth, start, end in self._closed]
        step = spans.pop()
        spans.sort(key=lambda s: (s.start, s.depth))
        return [step, *spans]

    def __reduce__(self) -> tuple:
        """Pickled with each clock as its track's name (a device clock holds GPU events): the record a process
        that did not run the step receives."""
        closed = [(name, clock.track, depth, start, end) for name, clock, depth, start, end in self._closed]
        return _received_record, (self.index, closed, self.args)

    def phase_seconds(self) -> dict[str, float]:
        """Seconds per phase name within the step (summed over layers), the step itself excluded."""
        totals: dict[str, float] = {}
        for name, _, _, start, end in self._closed[:-1]:
            totals[name] = totals.get(name, 0.0) + end - start
        return totals


class _TrackClock(Clock):
    """A clock known by its track's name alone: the clocks of a record received from another process."""

    def __init__(self, track: str):
        self.track = track


def _received_record(index: int, closed: list[tuple[str, str, int, float, float]], args: dict[str, Any]) -> StepRecord:
    clocks = {track: _TrackClock(track) for track in {entry[1] for entry in closed}}
    return StepRecord(index, [(name, clocks[track], depth, start, end) for name, track, depth, start, end in closed],
                      args)


StepSink = Callable[[StepRecord], None]
PROFILE_ENV = "COLIBRI_STEP_LOOP_PROFILE"  # a file path: the step loop runs under cProfile, its stats written there


@contextmanager
def profiled(path: str | None) -> Iterator[None]:
    """Run the body under cProfile (the calling thread's) and write its stats to `path` (pstats' format) at the
    end; nothing without a path."""
    if not path:
        yield
        return
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        profile.dump_stats(path)
_NO_PHASE = nullcontext()


class _Phase:
    """The context manager of one phase name on one clock; the marks of open phases live on the timer's stack."""

    __slots__ = ("name", "clock", "_mark", "_starts", "_closed", "_timer")

    def __init__(self, timer: StepTimer, name: str, clock: Clock):
        self.name, self.clock, self._mark = name, clock, clock.mark
        self._starts, self._closed, self._timer = timer._starts, timer._closed, timer

    def __enter__(self) -> None:
        self._starts.append(self._mark())

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        starts = self._starts
        start = starts.pop()
        self._closed.append((self.name, self.clock, len(starts), start, self._mark()))
        if not starts:
            self._timer._finish_step()


class StepTimer:
    """Records the nested phases of engine steps and hands each finished step to its sinks.

    The outermost phase is the step: `with timer.phase("step"):` around the step, `with timer.phase(name):` around
    host work inside it, `with timer.device_phase(name):` around the model's work (the backend's clock).
    Driven by one thread at a time (the engine's step thread). `add_sink` enables it; setting `enabled` to False
    pauses it between steps.
    """

    def __init__(self, device_clock: Clock = HOST_CLOCK):
        self.enabled = False
        self._device = device_clock
        self._device_paused = False  # inside paused_device()
        self._sinks: list[StepSink] = []
        self._host_phases: dict[str, _Phase] = {}
        self._device_phases: dict[str, _Phase] = {}
        self._starts: list[Any] = []  # marks of the open phases, outermost first
        self._closed: list[_Closed] = []  # the running step's closed phases
        self._args: dict[str, Any] = {}
        self._num_steps = 0

    def add_sink(self, sink: StepSink) -> None:
        """Send every later step to `sink` (called in the stepping thread) and enable the timer."""
        self._sinks.append(sink)
        self.enabled = True

    def phase(self, name: str) -> Any:
        """A context manager timing `name` on the host clock (a no-op while disabled)."""
        if not self.enabled:
            return _NO_PHASE
        return self._host_phases.get(name) or self._new_phase(self._host_phases, name, HOST_CLOCK)

    def device_phase(self, name: str) -> Any:
        """A context manager timing `name` on the backend's clock (a no-op while disabled)."""
        if not self.enabled or self._device_paused:
            return _NO_PHASE
        return self._device_phases.get(name) or self._new_phase(self._device_phases, name, self._device)

    @contextmanager
    def paused_device(self) -> Iterator[None]:
        """Leave the device phases opened inside untimed: work launched ahead of the step that reads it, whose
        markers the step's end would wait for."""
        device, self._device_paused = self._device_paused, True
        try:
            yield
        finally:
            self._device_paused = device

    def annotate(self, **args: Any) -> None:
        """Attach figures (tokens, sequences) to the running step's record."""
        if self.enabled:
            self._args.update(args)

    def _new_phase(self, phases: dict[str, _Phase], name: str, clock: Clock) -> _Phase:
        phase = phases[name] = _Phase(self, name, clock)
        return phase

    def _finish_step(self) -> None:
        closed, args = self._closed.copy(), self._args
        self._closed.clear()
        self._args = {}
        device = self._device
        if device is not HOST_CLOCK:  # the device's markers become seconds now that the step is over
            seconds = iter(device.seconds([mark for entry in closed if entry[1] is device for mark in entry[3:]]))
            closed = [(name, clock, depth, next(seconds), next(seconds)) if clock is device else
                      (name, clock, depth, start, end) for name, clock, depth, start, end in closed]
        record = StepRecord(self._num_steps, closed, args)
        self._num_steps += 1
        for sink in self._sinks:
            sink(record)


class ChromeTraceWriter:
    """A step sink writing Chrome-trace JSON (the array format): one complete event per phase, one track per clock
    stream, timestamps in microseconds since the writer opened. `close()` ends the array; a file cut short by a
    crash still opens (the closing bracket is optional in the format)."""

    def __init__(self, path: str | Path):
        self._file = open(path, "wb")
        self._file.write(b"[\n")
        self._origin = time.perf_counter()
        self._pid = os.getpid()
        self._tracks: dict[str, int] = {}
        self._write({"name": "process_name", "ph": "M", "pid": self._pid, "tid": 0, "args": {"name": "colibri"}},
                    first=True)

    def __call__(self, record: StepRecord) -> None:
        origin, pid = self._origin, self._pid
        events = [{"name": span.name, "cat": "phase", "ph": "X", "ts": (span.start - origin) * 1e6,
                   "dur": (span.end - span.start) * 1e6, "pid": pid, "tid": self._track(span.track)}
                  for span in record.spans]
        events[0].update(cat="step", args=dict(record.args, step=record.index))
        self._file.write(b",\n" + orjson.dumps(events)[1:-1])  # the events without the list's brackets

    def close(self) -> None:
        if not self._file.closed:
            self._file.write(b"\n]\n")
            self._file.close()

    def __enter__(self) -> ChromeTraceWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _track(self, name: str) -> int:
        tid = self._tracks.get(name)
        if tid is None:
            tid = self._tracks[name] = len(self._tracks) + 1
            self._write({"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tid, "args": {"name": name}})
        return tid

    def _write(self, event: dict, first: bool = False) -> None:
        self._file.write((b"" if first else b",\n") + orjson.dumps(event))
