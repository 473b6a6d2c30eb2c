"""Per-request parameters shared by the offline API, the engine and the server."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ColibriError


class InvalidParameterError(ColibriError):
    """A sampling parameter is out of range; the message names the parameter."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


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
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top k
    n: int = 1

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidParameterError(f"{param} {message}", param)

        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", "must be a positive integer")
        check(0.0 <= self.temperature <= 100.0, "temperature", "must be between 0 and 100")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be -1, 0 (off) or a positive integer")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be between -2 and 2")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be between -2 and 2")
        check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
              "logprobs", "must be an integer between 0 and 20")
        check(isinstance(self.n, int) and 1 <= self.n <= 16, "n", "must be an integer between 1 and 16")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(len(self.stop) <= 16, "stop", "may hold at most 16 strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
