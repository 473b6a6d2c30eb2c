"""Requests and their parameters, shared by the offline API, the engine and the server."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .errors import InvalidParameterError, PromptTooLongError



@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated at construction: a bad value raises InvalidParameterError."""

    max_tokens: int | None = 16  # None: until max_seq_len
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; matched across token boundaries, not sent to the client
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top k
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob (from the second on: the
    # first has no context) and the top k at its position; the prompt is then computed whole (no prefix cache)
    grammar: str | None = None  # llguidance grammar the tokens must follow (structured.json_schema_grammar)
    min_tokens: int = 0  # output tokens before an end-of-sequence or stop token may be drawn (vLLM's)
    skip_special_tokens: bool = True  # the text leaves out special tokens (vLLM's)
    include_stop_str_in_output: bool = False  # the stop string or stop token that ends the text is part of it (vLLM's)
    n: int = 1

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidParameterError(f"{param} {message}", param)

        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", "must be a positive integer")
        check(0.0 <= self.temperature <= 100.0, "temperature", "must be between 0 and 100")
        check(0.0 <= self.top_p <= 1.0, "top_p", "must be in [0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be -1, 0 (off) or a positive integer")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**64), "seed",
              "must be an integer that fits in 64 bits (signed or unsigned)")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be between -2 and 2")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be between -2 and 2")
        check(0.01 <= self.repetition_penalty <= 10.0, "repetition_penalty", "must be in [0.01, 10]")
        check(all(isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias), "logit_bias",
              "must map token ids to biases between -100 and 100")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and 0 <= value <= 20), name,
                  "must be an integer between 0 and 20")
        check(isinstance(self.n, int) and 1 <= self.n <= 16, "n", "must be an integer between 1 and 16")
        check(self.grammar is None or isinstance(self.grammar, str), "grammar", "must be a string")
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
              "min_tokens", "must be an integer between 0 and max_tokens")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(len(self.stop) <= 16, "stop", "may hold at most 16 strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0






def check_length(prompt_tokens: int, max_tokens: int | None, max_seq_len: int) -> int:
    """Admission rule: the prompt leaves room for at least one token and for max_tokens; returns the token limit.

    Raises PromptTooLongError; the returned limit is how many output tokens the request may produce.
    """
    limit = max_seq_len - prompt_tokens
    if limit < 1 or (max_tokens is not None and max_tokens > limit):
        raise PromptTooLongError(prompt_tokens, max_tokens, max_seq_len)
    return limit if max_tokens is None else max_tokens


class RequestStatus(enum.Enum):
    """Where a sequence is in its life; only the scheduler moves it from one status to the next."""

    WAITING = "waiting"  # queued, never scheduled
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    PREEMPTED = "preempted"  # its blocks were taken; waits at the front of the queue to recompute them
    FINISHED_STOPPED = "stop"  # eos, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_seq_len
    FINISHED_ABORTED = "abort"  # the client went away or asked to cancel

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI `finish_reason` ("stop", "length", "abort"), None while unfinished."""
        return self.value if self.finished else None


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})

SeqId = tuple[str, int]  # (request_id, index among the request's n sequences)


class Request:
    """One sequence being generated: its tokens, how many of them are in the KV cache, and its status.

    A request with `n > 1` is scheduled as n of these, one per `index`. `token_ids` holds the prompt followed by
    the output; the tokens from `num_computed_tokens` on still have to go through the model (after a preemption
    that includes the output generated so far, which is recomputed).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), index: int = 0, arrival_time: float = 0.0):
        self.request_id = request_id
        self.index = index
        self.params = params
        self.max_tokens = params.max_tokens  # output tokens allowed; admission fills in what max_seq_len leaves
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time  # time.monotonic() when the request arrived
        self.token_ids = list(prompt_token_ids)  # prompt, then output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens: int | None = None  # prompt tokens its first admission took from the prefix cache
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None  # the stop string or stop token id that finished it
        # With params.prompt_logprobs: prompt tokens 1 .. P - 1's logprobs, filled as the prompt is computed
        self.prompt_logprobs: list[Logprob] | None = [] if params.prompt_logprobs is not None else None

    @property
    def seq_id(self) -> SeqId:
        return self.request_id, self.index

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, index={self.index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")


Logprob = tuple[int, float, list[tuple[int, float]]]  # (token id, its logprob, [(id, logprob) of the top k])


@dataclass
class RequestOutput:
    """What one sequence produced since the consumer last looked: usually one step, merged steps if it lagged."""

    request_id: str
    index: int  # which of the request's n sequences
    text: str  # new text (a delta; held-back stop-string prefixes and partial characters come later)
    token_ids: list[int]  # new token ids
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    stop_reason: str | int | None  # the stop string or stop token id that finished it; None for eos
    prompt_tokens: int
    completion_tokens: int  # output tokens so far
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed (first admission)
    logprobs: list[Logprob] | None = None  # one per new token when the request asked for logprobs
    # On the sequence's first output, when the request asked for prompt logprobs: the prompt's tokens, and the
    # logprobs of tokens 1 .. P - 1 (the first has no context)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[Logprob] | None = None
    time_to_first_token: float | None = None  # seconds from arrival to the first token; on the output carrying it
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds before each later new token

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This output followed by `later` of the same sequence, as one delta."""
        return RequestOutput(
            request_id=self.request_id,
            index=self.index,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            finished=later.finished,
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
            prompt_tokens=later.prompt_tokens,
            completion_tokens=later.completion_tokens,
            cached_tokens=later.cached_tokens,
            logprobs=None if self.logprobs is None else self.logprobs + (later.logprobs or []),
            prompt_token_ids=self.prompt_token_ids if self.prompt_token_ids is not None else later.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            time_to_first_token=self.time_to_first_token if self.time_to_first_token is not None
            else later.time_to_first_token,
            inter_token_latencies=self.inter_token_latencies + later.inter_token_latencies,
        )
