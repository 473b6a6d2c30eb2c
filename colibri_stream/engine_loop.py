"""The step loop that drives an `EngineCore` for `AsyncEngine`, on a thread of the serving process or in a child
process of its own (`engine_process.py`): the same loop over either transport.

Commands come in through `receive` (AddRequest, AbortRequest, StopLoop), applied between steps; everything the
loop has to say goes out through `publish`, one `StepReport` per batch of commands applied and per step (every
output of the step in it, never one message per token), and a `LoopEnded` last.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ColibriError, RequestsFailedError, describe
from .experts.stats import ExpertStats
from .request import RequestOutput, SamplingParams
from .timing import PROFILE_ENV, StepRecord, profiled

if TYPE_CHECKING:
    from .engine import EngineCore, EngineStats

logger = logging.getLogger(__name__)


@dataclass
class AddRequest:
    """Queue a request that `AsyncEngine.generate` has encoded and validated."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() (one clock for every process of the machine)


@dataclass
class AbortRequest:
    """Abort a request; `ack`, when given, comes back in the report of the batch that freed its KV blocks."""

    request_id: str
    ack: int | None = None


@dataclass
class StopLoop:
    """End the loop once the running requests finish (drain) or after aborting them."""

    drain: bool


Command = AddRequest | AbortRequest | StopLoop


@dataclass
class StepFailure:
    """A step failed as a whole (the forward pass): `request_ids` were aborted with it."""

    request_ids: set[str]
    error: BaseException


@dataclass
class StepReport:
    """What one batch of commands or one step produced, with the engine's state after it.

    Pickled to cross from the engine's process to the server's: errors whatever their constructor
    (`portable_error`), outputs as tuples of their fields (a third of the cost of pickling the dataclasses).
    """

    outputs: list[RequestOutput]
    stats: EngineStats
    num_applied: int  # sequences of AddRequest commands applied so far
    acks: list[int] = field(default_factory=list)  # AbortRequest acks whose requests are freed
    failed: dict[str, BaseException] = field(default_factory=dict)  # requests that ended alone, and why
    step_failure: StepFailure | None = None
    step_records: list[StepRecord] = field(default_factory=list)  # the step's phases, where the loop times them
    store_stats: ExpertStats | None = None  # the expert store's counters, where the reader cannot ask the store

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["outputs"] = [tuple(vars(out).values()) for out in self.outputs]  # in the order of its fields
        state["failed"] = {request_id: portable_error(error) for request_id, error in self.failed.items()}
        if self.step_failure is not None:
            state["step_failure"] = StepFailure(self.step_failure.request_ids, portable_error(self.step_failure.error))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["outputs"] = [RequestOutput(*fields) for fields in state["outputs"]]
        self.__dict__.update(state)


@dataclass
class LoopEnded:
    """The loop's last message: `error` is None where it stopped as asked, else what broke the loop."""

    error: BaseException | None

    def __getstate__(self) -> dict[str, Any]:
        return {"error": None if self.error is None else portable_error(self.error)}


def run_step_loop(core: EngineCore, receive: Callable[[bool], list[Command]],
                  publish: Callable[[StepReport | LoopEnded], None]) -> None:
    """Apply commands and step `core` until a StopLoop's requests are done, then publish LoopEnded.

    receive(block) returns the commands waiting, waiting for at least one when `block` (the engine is idle).
    A request that fails alone is reported in `failed`, a failed step in `step_failure`, and the loop goes on;
    only an error outside a step (a bug in the loop) ends it early, with that error in LoopEnded. An exception
    that is not an `Exception` (the other side of a pipe gone) leaves without publishing. With the environment
    variable COLIBRI_STEP_LOOP_PROFILE naming a file, the loop runs under cProfile and writes its stats there."""
    error = None
    try:
        with profiled(os.environ.get(PROFILE_ENV)):
            _loop(core, receive, publish)
    except Exception as exc:  # the engine is unusable: every waiting consumer learns why
        logger.exception("engine step loop failed")
        error = exc
    publish(LoopEnded(error))


def _loop(core: EngineCore, receive: Callable[[bool], list[Command]],
          publish: Callable[[StepReport | LoopEnded], None]) -> None:
    stopping = False
    num_applied = 0
    while not (stopping and not core.has_unfinished()):
        commands = receive(not (stopping or core.has_unfinished()))
        if commands:
            outputs: list[RequestOutput] = []
            acks: list[int] = []
            refused: dict[str, BaseException] = {}
            for command in commands:
                if isinstance(command, AddRequest):
                    num_applied += command.params.n
                    try:
                        core.add_request(command.request_id, command.prompt_token_ids, command.params,
                                         command.arrival_time, validated=True)
                    except (ColibriError, ValueError) as exc:
                        refused[command.request_id] = exc
                elif isinstance(command, AbortRequest):
                    outputs += core.abort(command.request_id)
                    if command.ack is not None:
                        acks.append(command.ack)
                else:
                    stopping = True
                    if not command.drain:
                        outputs += core.abort_all()
            publish(StepReport(outputs, core.stats(), num_applied, acks=acks, failed=refused))
        if not core.has_unfinished():
            continue
        try:
            outputs = core.step()
        except RequestsFailedError as failed:  # those requests alone; the others' outputs go on
            for request_id, failure in failed.errors.items():
                logger.warning("request %s failed: %s", request_id, failure)
            publish(StepReport(failed.outputs, core.stats(), num_applied, failed=dict(failed.errors)))
            continue
        except Exception as exc:  # this step's requests fail; the engine serves the next ones
            logger.exception("engine step failed; aborting its requests")
            aborted = {out.request_id for out in core.abort_all()}
            publish(StepReport([], core.stats(), num_applied, step_failure=StepFailure(aborted, exc)))
            continue
        publish(StepReport(outputs, core.stats(), num_applied))


def portable_error(error: BaseException) -> BaseException:
    """`error` in a form that pickles and unpickles as the same type with the same message and attributes (an
    exception pickles as its class called with its args, which fails where the constructor takes other ones);
    where its attributes do not pickle, an error of the nearest kind with its one line (`describe`)."""
    portable = _PortableError(error)
    try:
        pickle.loads(pickle.dumps(portable))
    except Exception:  # noqa: BLE001 - an attribute that does not pickle, a class defined in a function
        return (ColibriError if isinstance(error, ColibriError) else RuntimeError)(describe(error))
    return portable  # type: ignore[return-value]  # unpickles as the error itself


class _PortableError:
    """Pickles an exception as its class, its args and its attributes, rebuilt without calling its constructor."""

    def __init__(self, error: BaseException):
        self.error = error

    def __reduce__(self) -> tuple:
        error = self.error
        return _rebuild_error, (type(error), error.args, dict(vars(error)))


def _rebuild_error(cls: type[BaseException], args: tuple, attributes: dict[str, Any]) -> BaseException:
    error = cls.__new__(cls, *args)
    error.args = args
    vars(error).update(attributes)
    return error
