"""Admission of a generation request, once for every API and before anything is sent: the capacity a batch of
prompts needs, the grammar (compiled whole, so that one that would fail inside a step is refused here), each
prompt tokenized (chat messages through the template; refused for its length before it is tokenized whole), and
whether the template left the reply inside a thinking block. Refusals are ColibriErrors (the engine's own),
naming the prompt of a batch that they concern (PromptRefused); error_replies.py makes them HTTP errors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ColibriError, InvalidParameterError, PromptRefused
from .generate_request import GenerateRequest
from .reasoning import opens_thinking

PROMPT_TAIL_TOKENS = 8  # the prompt's last tokens, whose text shows whether the template opened a thinking block


@dataclass(frozen=True)
class Admission:
    """A request's prompts as the engine will run them."""

    prompt_token_ids: list[list[int]]  # per prompt: its token ids (chat: the rendered template's)
    thinking_started: bool  # with split_reasoning: the prompt leaves the reply inside the thinking tag

    @property
    def prompt_tokens(self) -> list[int]:
        """Each prompt's token count."""
        return [len(ids) for ids in self.prompt_token_ids]


async def admit(engine: Any, req: GenerateRequest, decode: Callable[[list[int]], str]) -> Admission:
    """Check and tokenize `req`'s prompts for `engine` (its AsyncEngine); `decode`: token ids -> text, special
    tokens included. Raises the refusal: InvalidParameterError, PromptTooLongError, ChatTemplateError, ..."""
    prompts, params = req.prompts, req.params
    capacity, wanted = engine.capacity, len(prompts) * params.n
    if capacity is not None and len(prompts) > 1 and wanted > capacity:  # else every retry would get a 429
        raise InvalidParameterError(f"{len(prompts)} prompts of n={params.n} are {wanted} sequences, which can "
                                    f"never be admitted together: this server runs at most {capacity} at once "
                                    f"(max_batch_size + max_queue)", param="prompt")
    if params.grammar is not None:
        await engine.check_grammar(params.grammar)
    keep = req.truncate_prompt_tokens
    keep_last = engine.max_seq_len if keep == -1 else keep  # cut to its last tokens: not refused for its length
    token_ids = []
    for i, prompt in enumerate(prompts):
        try:
            # a long prompt is encoded off the event loop
            token_ids.append(await engine.encode(prompt, tools=req.template_tools, template_kwargs=req.template_kwargs,
                                                 keep_last=keep_last))
        except ColibriError as error:
            refusal = of_prompt(error, i, len(prompts))
            if refusal is error:
                raise  # as its own cause, a reference cycle would keep its frames and the prompt until a full GC
            raise refusal from error
    started = req.split_reasoning and opens_thinking(decode(token_ids[0][-PROMPT_TAIL_TOKENS:]))
    return Admission(token_ids, started)


def of_prompt(error: BaseException, index: int, count: int) -> BaseException:
    """A prompt's refusal, naming the prompt when the request holds several."""
    return PromptRefused(error, index) if count > 1 and isinstance(error, ColibriError) else error
