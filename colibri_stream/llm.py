"""Synchronous offline generation: the engine core driven in the caller's thread, no server, no event loop."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterator

from .engine import EngineCore
from .request import Logprob, SamplingParams


@dataclass
class GenerationResult:
    """One finished completion."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_logprobs: list[Logprob] | None = None  # with SamplingParams.prompt_logprobs: prompt tokens 1 .. P - 1's


class LLM:
    """Offline generation over a model folder (the shipped model when `model` is None).

    `generate` completes prompts (several at once are batched by the engine); `stream` yields one prompt's text
    as it is produced. Prompts are text, token ids, or chat messages (a list of {"role", "content"} dicts).
    `options` are the engine's (device, verify, max_seq_len, max_batch_size, kv_cache_memory, kv_cache_dtype,
    gpu_memory_utilization, ...).
    `close()` (or leaving a `with LLM(...) as llm:` block) joins every thread the engine started; an LLM that is
    collected, or still open when the interpreter exits, is closed then.
    """

    def __init__(self, model: str | None = None, **options: Any):
        self.engine = EngineCore.from_pretrained(model, **options)
        self._finalizer = weakref.finalize(self, self.engine.close)

    def close(self) -> None:
        """Close the engine (`EngineCore.close`); the LLM is not used after."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stream(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None) -> Iterator[str]:
        """Text deltas of one completion, as soon as each is final."""
        for output in self._run([prompt], params or SamplingParams()):
            if output.text:
                yield output.text

    def generate(self, prompts: str | list[int] | list[dict] | list, params: SamplingParams | None = None
                 ) -> GenerationResult | list[GenerationResult]:
        """Complete one prompt, or a list of prompts (text or token-id lists) batched together."""
        single = isinstance(prompts, str) or not prompts or not isinstance(prompts[0], (str, list))
        batch = [prompts] if single else list(prompts)
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("LLM.generate returns one completion per prompt; use n=1")
        prompt_ids = [self.engine.encode_prompt(p) for p in batch]
        results = [GenerationResult(ids, [], "", "") for ids in prompt_ids]
        for output in self._run_ids(prompt_ids, params):
            result = results[int(output.request_id)]
            result.token_ids += output.token_ids
            result.text += output.text
            if output.prompt_logprobs is not None:
                result.prompt_logprobs = output.prompt_logprobs
            if output.finished:
                result.finish_reason = output.finish_reason
        return results[0] if single else results

    def _run(self, prompts: list, params: SamplingParams):
        return self._run_ids([self.engine.encode_prompt(p) for p in prompts], params)

    def _run_ids(self, prompt_ids: list[list[int]], params: SamplingParams):
        """Outputs of every step until all the prompts finish; request ids are the prompts' positions.

        Every prompt is validated before any is queued, and whatever is left is aborted on the way out, so one
        call's requests never meet another's.
        """
        for ids in prompt_ids:
            self.engine.validate(ids, params)
        for index, ids in enumerate(prompt_ids):
            self.engine.add_request(str(index), ids, params)
        try:
            while self.engine.has_unfinished():
                yield from self.engine.step()
        finally:
            self.engine.abort_all()
