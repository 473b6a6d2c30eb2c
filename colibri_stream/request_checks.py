"""The request-side checks of an engine: tokenize a prompt, validate a request against the model's limits.

They need the tokenizer, the model's config and max_seq_len, not the model's weights, so the process that serves
HTTP runs them itself where the steps run in a child process (`engine_process.py`), and `EngineCore` delegates
to the same code in-process.
"""

from __future__ import annotations

import logging

from .config import ModelConfig
from .errors import InvalidParameterError, PromptTooLongError
from .request import SamplingParams, check_length
from .structured import Constraints
from .tokenizer import Tokenizer
from .tokenizer.prompt_bound import CharLimit, max_chars_per_token

log = logging.getLogger(__name__)


class RequestChecks:
    """Encodes prompts and checks requests for one model: `encode_prompt`, `validate`, `check_grammar`.

    eos_token_ids: the tokens that end a sequence (the tokenizer's and the model config's); `constraints` holds
    the grammars checked against this tokenizer (the runner builds its sequences' constraints from it).
    """

    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, max_seq_len: int,
                 eos_token_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_seq_len = max_seq_len
        if tokenizer.vocab_size > model_config.vocab_size:  # a prompt holding such a token is refused (validate)
            log.warning("the tokenizer has token ids up to %d, past config.json's vocab_size %d: the tokenizer does "
                        "not match the model", tokenizer.vocab_size - 1, model_config.vocab_size)
        self.constraints = Constraints(tokenizer.to_json(), model_config.vocab_size, tuple(sorted(eos_token_ids)))
        per_token = max_chars_per_token(tokenizer.to_json())
        # the most characters a prompt can have and fit max_seq_len (None: this tokenizer bounds no token's span)
        self.prompt_char_limit = None if per_token is None else CharLimit(max_seq_len, per_token)

    def encode_prompt(self, prompt: str | list[int] | list[dict], add_special_tokens: bool = True,
                      tools: list[dict] | None = None, template_kwargs: dict | None = None,
                      keep_last: int | None = None, fit_context: bool = True) -> list[int]:
        """Token ids of a text, a list of token ids, or chat messages (rendered with the chat template, which is
        shown `tools` when given, and `template_kwargs`: its variables, such as enable_thinking, and
        add_generation_prompt, true unless given).

        A prompt that certainly has more tokens than max_seq_len raises PromptTooLongError before it is tokenized
        or rendered whole: a text, or a chat's rendering so far, of more characters than `prompt_char_limit`, or
        more token ids than max_seq_len. Not so with `keep_last` (the last keep_last ids are returned: vLLM's
        truncate_prompt_tokens) or with fit_context=False (a prompt counted whatever its length)."""
        if not prompt:
            raise InvalidParameterError("prompt must not be empty", param="prompt")
        limit = self.prompt_char_limit if fit_context and keep_last is None else None
        if isinstance(prompt, str):
            if limit is not None:
                limit.check_text(len(prompt))
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif all(isinstance(m, dict) for m in prompt):
            options = {"add_generation_prompt": True, **(template_kwargs or {})}
            text = self.tokenizer.apply_chat_template(prompt, tools=tools, char_limit=limit, **options)
            ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens
        else:
            if fit_context and keep_last is None and len(prompt) > self.max_seq_len:
                raise PromptTooLongError(len(prompt), None, self.max_seq_len)
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
                raise InvalidParameterError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
            ids = list(prompt)
        return ids if keep_last is None else ids[-keep_last:]

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The admission checks, callable from any thread: InvalidParameterError, PromptTooLongError."""
        if not prompt_token_ids:
            raise InvalidParameterError("prompt must not be empty", param="prompt")
        vocab = self.model_config.vocab_size
        if self.tokenizer.vocab_size > vocab and max(prompt_token_ids) >= vocab:  # (ids given as such are checked)
            raise InvalidParameterError(f"the prompt encodes to token id {max(prompt_token_ids)}, past the model's "
                                        f"vocabulary of {vocab}: the model folder's tokenizer does not match its "
                                        "config.json", param="prompt")
        if any(token_id >= vocab for token_id, _ in params.logit_bias):
            raise InvalidParameterError(f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
        if params.grammar is not None:
            self.constraints.check(params.grammar)
        check_length(len(prompt_token_ids), params.max_tokens, self.max_seq_len)

    def check_grammar(self, grammar: str) -> None:
        """Raise InvalidParameterError if `grammar` cannot be used with this tokenizer (`Constraints.check`)."""
        self.constraints.check(grammar)

    def close(self) -> None:
        """Wait for the grammar tokenizer's build (a thread that is not a daemon)."""
        self.constraints.close()
