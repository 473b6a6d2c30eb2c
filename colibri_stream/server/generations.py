"""The engine requests behind one HTTP request: one per prompt (a /v1/completions batch has several), admitted
before anything is sent, their outputs merged into one stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ..errors import ColibriError
from ..request import InvalidParameterError, RequestOutput, SamplingParams

_END = object()  # a prompt's pump has sent its last output


class PromptRefused(ColibriError):
    """The refusal of one prompt of a batch: what the engine raised (`error`) and the prompt's `index`."""

    def __init__(self, error: ColibriError, index: int):
        super().__init__(f"prompt {index}: {error}")
        self.error, self.index = error, index


class Generations:
    """The engine requests of one HTTP request, one per prompt.

    `start()` submits every prompt and returns once the engine has admitted them all, raising the first refusal;
    `outputs()` yields (prompt index, RequestOutput) as they come; `aclose()`, called whatever happened, aborts the
    requests that have not finished (freeing their KV blocks) and returns without waiting when all have.
    """

    def __init__(self, engine: Any, request_id: str):
        self._engine = engine
        self._request_id = request_id
        self._sources: list[AsyncIterator[RequestOutput]] = []
        self._tasks: list[asyncio.Future] = []  # each prompt's first output; with several prompts, then its pump
        self.prompt_tokens: list[int] = []  # each prompt's token count, once `start` has encoded them
        self.prompt_token_ids: list[list[int]] = []  # and its token ids

    async def start(self, prompts: Sequence[Any], params: SamplingParams, tools: list[dict] | None = None,
                    keep_last: int | None = None, template_kwargs: dict | None = None) -> None:
        """Encode the prompts (chat messages shown `tools` and `template_kwargs`; each cut to its last `keep_last`
        tokens when given, and then not refused for its length before it is tokenized) and
        have the engine admit each (raises its refusal: InvalidParameterError, PromptTooLongError, QueueFullError,
        ...)."""
        capacity, wanted = self._engine.capacity, len(prompts) * params.n
        if capacity is not None and len(prompts) > 1 and wanted > capacity:  # else every retry would get a 429
            raise InvalidParameterError(f"{len(prompts)} prompts of n={params.n} are {wanted} sequences, which can "
                                        f"never be admitted together: this server runs at most {capacity} at once "
                                        f"(max_batch_size + max_queue)", param="prompt")
        if params.grammar is not None:
            await self._engine.check_grammar(params.grammar)
        token_ids = []
        for i, prompt in enumerate(prompts):
            try:
                # a long prompt is encoded off the event loop
                token_ids.append(await self._engine.encode(prompt, tools=tools, template_kwargs=template_kwargs,
                                                           keep_last=keep_last))
            except ColibriError as error:
                refusal = _of_prompt(error, i, len(prompts))
                if refusal is error:
                    raise  # as its own cause, a reference cycle would keep its frames and the prompt until a full GC
                raise refusal from error
        self.prompt_token_ids = token_ids
        self.prompt_tokens = [len(ids) for ids in token_ids]
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
                raise _of_prompt(error, i, len(prompts))

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


def _of_prompt(error: BaseException, index: int, count: int) -> BaseException:
    """A prompt's refusal, naming the prompt when the request holds several."""
    return PromptRefused(error, index) if count > 1 and isinstance(error, ColibriError) else error
