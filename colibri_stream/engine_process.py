"""The engine's steps in a child process: `EngineProcess` starts it (spawn) and talks to it over two pipes.

The serving process's Python (HTTP, rendering, SSE writes) and the step loop's Python (scheduling, sampling
glue, detokenizing) would otherwise share one GIL, and every token's server work would lengthen the step. The
child loads the model (`EngineCore.from_pretrained`, the only place the device is touched) and runs
`engine_loop.run_step_loop`; the parent keeps the tokenizer and the admission checks (`request_checks.py`).

Messages, pickled by `multiprocessing.Connection`: parent to child, `StartLoop`, the loop's commands and
`CloseEngine`; child to parent, `EngineReady` (or `LoadFailed`) once, then one `StepReport` per batch of
commands and per step and a `LoopEnded` per run of the loop. The child ignores SIGINT and SIGTERM (a Ctrl-C
reaches the whole process group; the parent drains and then closes it) and ends when its command pipe reaches
end of file: the parent closed it, or died.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from .config import ModelConfig
from .engine_loop import Command, LoopEnded, StepReport, portable_error, run_step_loop
from .errors import EngineStoppedError
from .experts.stats import ExpertStats
from .timing import StepSink

if TYPE_CHECKING:
    from .engine import EngineCore, EngineStats

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_SECONDS = 60.0  # how long `close` waits for the child to close its engine before killing it
STORE_STATS_SECONDS = 0.25  # the expert store's counters ride on a step report at most this often (a monitoring
#                             read: a tiered store's snapshot has arrays per layer and expert, too much per step)


@dataclass
class StartLoop:
    """Run the step loop (again); time_steps: send each step's StepRecord with its report."""

    time_steps: bool


@dataclass
class CloseEngine:
    """Close the engine core (`EngineCore.close`) and exit."""


@dataclass
class EngineReady:
    """The loaded engine's figures that the parent needs before any step."""

    model_config: ModelConfig
    max_seq_len: int
    stats: EngineStats
    store_stats: ExpertStats | None


@dataclass
class LoadFailed:
    """The model did not load: `error` is what `EngineCore.from_pretrained` raised."""

    error: BaseException

    def __getstate__(self) -> dict[str, Any]:
        return {"error": portable_error(self.error)}


class _ParentGone(BaseException):
    """The parent's end of a pipe closed: the child leaves without reporting (nobody reads)."""


class EngineProcess:
    """A child process running an EngineCore's step loop, seen from the parent.

    `__init__` spawns it and returns once the model loaded (`ready`), or raises what loading raised. `start_loop`
    runs the loop and a reader thread that hands each message to `deliver` (after passing its step records to
    the sinks); `send` queues a command; `close` ends the child and joins it. path and options: those of
    `EngineCore.from_pretrained`; env: environment variables set in the child before it loads anything (a data-parallel
    replica's CUDA_VISIBLE_DEVICES). load: what the child calls with (path, **options) to build its engine, in
    place of `EngineCore.from_pretrained` (picklable: an expert-parallel group's rank 0, `expert_group.py`);
    handed: pipe ends that `load` took to the child, closed here once it started.
    """

    def __init__(self, path: str | None, options: dict[str, Any], env: dict[str, str] | None = None,
                 load: Callable[..., EngineCore] | None = None, handed: tuple[Connection, ...] = ()):
        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        commands_in, self._commands = context.Pipe(duplex=False)
        self._events, events_out = context.Pipe(duplex=False)
        self._process = context.Process(target=_child_main, args=(path, options, env or {}, commands_in, events_out,
                                                                   logging.getLogger().getEffectiveLevel(), load),
                                        name="colibri-engine", daemon=True)
        self._process.start()
        # the child's ends (with those `load` took to it): the parent keeps its own, so EOF means the other side is gone
        for end in (commands_in, events_out, *handed):
            end.close()
        self._reader: threading.Thread | None = None
        self._sinks: list[StepSink] = []
        self._send_lock = threading.Lock()  # commands come from the event loop and from close()
        # At exit, before multiprocessing joins its children (which would wait for ever on a child that ignores
        # SIGTERM and waits for commands), and at close(): end of file on the command pipe, the child leaves.
        self._end = weakref.finalize(self, _end_child, self._process, self._commands)
        try:
            message = self._events.recv()
        except EOFError:
            self._process.join()
            raise EngineStoppedError(f"the engine process ended while loading the model "
                                     f"({_exit_status(self._process.exitcode)})") from None
        except BaseException:  # interrupted while the model loads: the child is of no use
            self._process.kill()
            self._end()
            raise
        if isinstance(message, LoadFailed):
            self._end()
            raise message.error
        self.ready: EngineReady = message
        self._store_stats = message.store_stats  # as of the last report

    @property
    def pid(self) -> int:
        return self._process.pid

    def add_step_sink(self, sink: StepSink) -> None:
        """Hand every step's StepRecord to `sink` on the reader thread, from the next `start_loop` on."""
        self._sinks.append(sink)

    def store_stats(self) -> ExpertStats | None:
        """The expert store's counters as of the last report that carried them: at most STORE_STATS_SECONDS old
        while steps run, the last step's once the engine is idle."""
        return self._store_stats

    def start_loop(self, deliver: Callable[[StepReport | LoopEnded], None]) -> None:
        """Run the step loop; `deliver` gets every message on the reader thread, the LoopEnded last (also, with
        an EngineStoppedError, where the child died)."""
        sinks = list(self._sinks)
        self.send(StartLoop(time_steps=bool(sinks)))
        self._reader = threading.Thread(target=self._read, args=(deliver, sinks), name="colibri-engine-reader",
                                        daemon=True)
        self._reader.start()

    def send(self, command: Command | StartLoop | CloseEngine) -> None:
        """Queue a command for the child; nothing where it has died (the reader reports that)."""
        try:
            with self._send_lock:
                self._commands.send(command)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass

    def join_loop(self) -> None:
        """Wait for the reader thread, which ends after the loop's LoopEnded."""
        if self._reader is not None:
            self._reader.join()
            self._reader = None

    def close(self) -> None:
        """Ask the child to close its engine and wait for it to exit (killed past CLOSE_TIMEOUT_SECONDS)."""
        self.send(CloseEngine())
        self._end()
        self._events.close()

    def _read(self, deliver: Callable[[StepReport | LoopEnded], None], sinks: list[StepSink]) -> None:
        while True:
            try:
                message = self._events.recv()
            except (EOFError, OSError):
                self._process.join(CLOSE_TIMEOUT_SECONDS)
                deliver(LoopEnded(EngineStoppedError(f"the engine process ended unexpectedly "
                                                     f"({_exit_status(self._process.exitcode)})")))
                return
            if isinstance(message, StepReport):
                if message.store_stats is not None:
                    self._store_stats = message.store_stats
                for record in message.step_records:
                    for sink in sinks:
                        sink(record)
            deliver(message)
            if isinstance(message, LoopEnded):
                return


def _end_child(process: multiprocessing.process.BaseProcess, commands: Connection) -> None:
    """Close the command pipe (the child closes its engine and leaves) and join the child, killed past
    CLOSE_TIMEOUT_SECONDS."""
    commands.close()
    process.join(CLOSE_TIMEOUT_SECONDS)
    if process.is_alive():
        logger.warning("the engine process did not exit in %g s; killing it", CLOSE_TIMEOUT_SECONDS)
        process.kill()
        process.join()


def _exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


# ---- the child ---------------------------------------------------------------------------------------------------

def _child_main(path: str | None, options: dict[str, Any], env: dict[str, str], commands: Connection,
                events: Connection, log_level: int, load: Callable[..., EngineCore] | None) -> None:
    os.environ.update(env)  # before the engine's imports, which read CUDA_VISIBLE_DEVICES and the thread counts
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .engine import EngineCore

    try:
        core = (load or EngineCore.from_pretrained)(path, **options)
    except BaseException as error:  # noqa: BLE001 - the parent raises it, as loading in-process would
        with contextlib.suppress(_ParentGone):
            _send(events, LoadFailed(error))
        return
    try:
        _send(events, EngineReady(core.model_config, core.max_seq_len, core.stats(), core.store_stats()))
        _serve(core, commands, events)
    except _ParentGone:
        pass
    finally:
        core.close()


def _serve(core: EngineCore, commands: Connection, events: Connection) -> None:
    """Run the step loop each time the parent asks, until CloseEngine (or the parent is gone)."""
    records: list = []  # the step records of the report being built
    timing = False

    def receive(block: bool) -> list[Command]:
        waiting = [_receive(commands)] if block else []
        while commands.poll():
            waiting.append(_receive(commands))
        return waiting

    stats_sent = time.monotonic()

    def publish(message: StepReport | LoopEnded) -> None:
        nonlocal stats_sent
        if isinstance(message, StepReport):
            message.step_records = records.copy()
            records.clear()
            # and on the last report before the engine idles, so a quiet engine's counters are whole
            if time.monotonic() - stats_sent >= STORE_STATS_SECONDS or not core.has_unfinished():
                message.store_stats = core.store_stats()
                stats_sent = time.monotonic()
        _send(events, message)

    while True:
        message = _receive(commands)
        if isinstance(message, CloseEngine):
            return
        if not isinstance(message, StartLoop):
            continue  # a command sent after the loop ended (an abort of a request it already ended)
        if message.time_steps and not timing:
            core.timer.add_sink(records.append)
            timing = True
        run_step_loop(core, receive, publish)


def _receive(connection: Connection) -> Any:
    try:
        return connection.recv()
    except (EOFError, OSError):
        raise _ParentGone from None


def _send(connection: Connection, message: Any) -> None:
    try:
        connection.send(message)
    except (BrokenPipeError, ConnectionResetError, OSError):
        raise _ParentGone from None
