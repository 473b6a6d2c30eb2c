"""Structured output: a grammar that constrains a sequence's tokens (JSON, a JSON schema, a regular expression, a
choice of strings, a Lark grammar), through llguidance.

`SamplingParams.grammar` holds a grammar in llguidance's format (`json_schema_grammar` builds one from a JSON
schema: what `response_format` asks for; `regex_grammar`, `choice_grammar` and `lark_grammar` what vLLM's
`structured_outputs` asks for). The engine checks it against its tokenizer when the request arrives
(`Constraints.check`), and the runner gives each such sequence a `TokenConstraint`: before each draw the sampler
sets the logits of the tokens the grammar does not allow next to -inf (`sampling.apply_penalties`), and the
runner feeds each sampled token back (`accept`). The end-of-sequence token is allowed only where the grammar may
end, so a sequence that stops on it holds a complete document; one cut by max_tokens holds its beginning.

llguidance (the Rust library that vLLM and llama.cpp's server also use) computes a step's mask over the whole
vocabulary in tens of microseconds; its view of the tokenizer takes about a second to build for a 150k-token
vocabulary, so each engine builds it on a thread of its own from the start, not on the server's event loop at the
first constrained request.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from .errors import GrammarError, InvalidParameterError


# JSON as json.dumps writes it: ", " and ": " between items, no other whitespace. A grammar that allows any run of
# whitespace lets a weak model write nothing else (a tiny model filled 300 tokens with spaces before a value).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: Any, param: str = "response_format") -> str:
    """The grammar of JSON documents valid under `schema` (a JSON schema object; {"type": "object"}: any object),
    laid out as JSON_LAYOUT. Errors name the request field `param`."""
    return _checked(lambda matcher: matcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT),
                    "the schema", param)


def regex_grammar(pattern: str, param: str) -> str:
    """The grammar of the texts that match the regular expression `pattern` whole (Rust regex syntax)."""
    return _checked(lambda matcher: matcher.grammar_from_regex(pattern), "the regular expression", param)


def lark_grammar(source: str, param: str) -> str:
    """The grammar written in Lark (llguidance's dialect: `start: ...` rules, /regex/ terminals)."""
    return _checked(lambda matcher: matcher.grammar_from_lark(source), "the grammar", param)


def choice_grammar(choices: list[str], param: str) -> str:
    """The grammar of exactly one of the strings `choices`: one terminal (a lexeme, matched by llguidance's lexer),
    so any number of choices is one parser item, where a rule of one alternative per choice stops past 2000
    (llguidance's max_items_in_row) at the first token."""
    return lark_grammar("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(choice) for choice in choices), param)


def _checked(build, what: str, param: str) -> str:
    """The grammar `build(LLMatcher)` makes, validated; an InvalidParameterError naming `param` if it is not one."""
    try:
        from llguidance import LLMatcher
    except ImportError as error:
        raise InvalidParameterError("structured output needs the llguidance package (pip install llguidance)",
                                    param) from error
    try:
        grammar = build(LLMatcher)
    except ValueError as error:
        raise InvalidParameterError(f"{what} cannot be used: {error}", param) from error
    error = LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if error:
        raise InvalidParameterError(f"{what} cannot be used: {error}", param)
    return grammar


def parser_limits():
    """llguidance's default limits, with errors that name the problem without the parser's state and the whole
    grammar (which a request's error message would otherwise carry, megabytes of it for a large grammar)."""
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)


CHECKED_GRAMMARS = 64  # grammars whose check's verdict Constraints keeps


class TokenConstraint:
    """One sequence's position in its grammar: the tokens allowed next, and the tokens taken so far."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next; GrammarError if the grammar failed (a parser limit reached).
        # [V] bool"""
        bits = np.frombuffer(self._matcher.compute_bitmask(), np.uint8)
        if self._matcher.is_error():
            raise GrammarError(f"the grammar failed: {self._matcher.get_error()}")
        return np.unpackbits(bits, bitorder="little")[: self._vocab_size].astype(bool)

    def accept(self, token: int) -> None:
        """Advance past a sampled token (always an allowed one); GrammarError if the grammar fails on it."""
        if not self._matcher.consume_token(token):
            raise GrammarError(f"the grammar failed on token {token}: {self._matcher.get_error()}")



class Constraints:
    """Grammars over one engine's tokenizer. tokenizer_json: the tokenizer in the tokenizers library's JSON;
    vocab_size: the model's (the logits' width); eos_token_ids: the tokens that end a sequence."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self._eos_token_ids = tuple(t for t in eos_token_ids if t < vocab_size)
        self._checked: dict[str, str] = {}  # grammar -> its check's error ("" where none), least recent first
        self._checked_lock = threading.Lock()  # checks run on the event loop's thread and on worker threads
        self._tokenizer = None
        self._error: Exception | None = None
        # Not a daemon: llguidance builds with the GIL released, and a daemon thread that takes the GIL back while
        # the interpreter finalises is ended by pthread_exit, whose unwinding through the library's Rust frames
        # crashes the process. The interpreter joins a thread that is not a daemon before it finalises.
        self._builder = threading.Thread(target=self._build, args=(tokenizer_json, list(eos_token_ids)),
                                         name="colibri-grammar-tokenizer")
        self._builder.start()

    def close(self) -> None:
        """Wait for the tokenizer's build (it cannot be interrupted)."""
        self._builder.join()

    def _build(self, tokenizer_json: str, eos: list[int]) -> None:
        try:
            from llguidance import LLTokenizer

            self._tokenizer = LLTokenizer(tokenizer_json, n_vocab=self.vocab_size, eos_token=eos)
        except Exception as error:  # noqa: BLE001 - reported to the first request that needs the tokenizer
            self._error = error

    def _llg_tokenizer(self):
        self._builder.join()
        if self._tokenizer is None:
            raise InvalidParameterError(f"structured output is not available: {self._error}", "grammar")
        return self._tokenizer

    def check(self, grammar: str) -> None:
        """Raise InvalidParameterError (param "grammar", SamplingParams') if `grammar` does not compile with this
        tokenizer or fails its first step (`_first_step_error`). The last CHECKED_GRAMMARS verdicts are kept: a
        request's grammar is checked once off the event loop (AsyncEngine.check_grammar), then again, at once,
        where the engine admits it."""
        from llguidance import LLMatcher

        with self._checked_lock:
            error = self._checked.pop(grammar, None)
        if error is None:
            tokenizer = self._llg_tokenizer()
            error = (LLMatcher.validate_grammar(grammar, tokenizer, limits=parser_limits())
                     or self._first_step_error(LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())))
        with self._checked_lock:
            self._checked[grammar] = error
            while len(self._checked) > CHECKED_GRAMMARS:
                del self._checked[next(iter(self._checked))]  # the least recently checked
        if error:
            raise InvalidParameterError(f"the grammar cannot be used with this model's tokenizer: {error}",
                                        "grammar")

    def _first_step_error(self, matcher) -> str:
        """The error a fresh matcher reaches computing its first mask and taking the first token it allows (the
        lowest id other than an end of sequence), "" if none. Limits that a grammar's size alone does not show,
        such as a rule of more than 2000 alternatives (max_items_in_row), are reached there; a grammar that
        reaches one only further on fails its request alone, in the step (`GrammarError`)."""
        bits = np.frombuffer(matcher.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)  # [V]
        allowed[list(self._eos_token_ids)] = False
        if not matcher.is_error() and allowed.any():
            matcher.consume_token(int(np.argmax(allowed)))
        return matcher.get_error() if matcher.is_error() else ""

    def constraint(self, grammar: str) -> TokenConstraint:
        """A fresh position at the start of `grammar`; GrammarError if llguidance refuses it."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llg_tokenizer(), grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {matcher.get_error()}")
        return TokenConstraint(matcher, self.vocab_size)
