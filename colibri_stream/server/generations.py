"""The engine requests behind one HTTP request: one per prompt (a /v1/completions batch has several), queued
before anything is sent, their outputs merged into one stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ..request import RequestOutput, SamplingParams
from .admission import of_prompt

_END = object()  # a prompt's pump has sent its last output


class Generations:
    """The engine requests of one HTTP request, one per prompt.

    `start()` submits every prompt and returns once the engine has queued them all, raising the first refusal;
    `outputs()` yields (prompt index, RequestOutput) as they come; `aclose()`, called whatever happened, aborts the
    requests that have not finished (freeing their KV blocks) and returns without waiting when all have.
    """

    def __init__(self, engine: Any, request_id: str):
        self._engine = engine
        self._request_id = request_id
        self._sources: list[AsyncIterator[RequestOutput]] = []
        self._tasks: list[asyncio.Future] = []  # each prompt's first output; with several prompts, then its pump

    async def start(self, token_ids: list[list[int]], params: SamplingParams) -> None:
        """Submit each admitted prompt's tokens (admission.py) and return once the engine has queued them all;
        raises the first refusal (QueueFullError, EngineStoppedError, ...)."""
        for i, ids in enumerate(token_ids):
            request_id = self._request_id if len(token_ids) == 1 else f"{self._request_id}-{i}"
            self._sources.append(self._engine.generate(ids, params, request_id=request_id))
        self._tasks = [asyncio.ensure_future(anext(source)) for source in self._sources]
        # generate() validates, checks the queue and queues its request in its first step, before it first waits
        # for an output; one turn of the loop runs those steps, so nothing is sent before the engine has said yes.
        await asyncio.sleep(0)
        refusals = [task.exception() if task.done() else None for task in self._tasks]  # all read: none unretrieved
        for i, error in enumerate(refusals):
            if error is not None:
                raise of_prompt(error, i, len(token_ids))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) until every prompt's sequences have finished; an engine failure raises."""
        if len(self._sources) == 1:
            yield 0, await self._tasks[0]
            async for out in self._sources[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue(maxsize=1)  # pumps wait for the consumer: a slow one gets merged deltas
        self._tasks = [asyncio.ensure_future(self._pump(i, first, queue)) for i, first in enumerate(self._tasks)]
        running = len(self._tasks)
        while running:
            index, out = await queue.get()
            if out is _END:
                running -= 1
            elif isinstance(out, BaseException):
                raise out
            else:
                yield index, out

    async def _pump(self, index: int, first: asyncio.Future, queue: asyncio.Queue) -> None:
        try:
            await queue.put((index, await first))
            async for out in self._sources[index]:
                await queue.put((index, out))
        except Exception as e:  # noqa: BLE001 - any failure is the consumer's to raise (a ColibriError: the HTTP error)
            await queue.put((index, e))
        await queue.put((index, _END))

    async def aclose(self) -> None:
        """Abort what has not finished; returns without waiting when everything has (the handler's last await)."""
        unfinished = [task for task in self._tasks if not task.done()]
        for task in unfinished:  # the client left, or a prompt was refused or failed
            task.cancel()
        if unfinished:
            await asyncio.gather(*unfinished, return_exceptions=True)
        for source in self._sources:
            await source.aclose()  # aborts an unfinished request; else returns at once

