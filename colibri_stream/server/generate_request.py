"""The validated generation request every API's parser produces and the admission, the engine and the
renderers read."""

from __future__ import annotations

from dataclasses import dataclass

from ..request import SamplingParams
from .tools import AutoCalls, ForcedCall


@dataclass(frozen=True)
class GenerateRequest:
    """A validated /v1/chat/completions or /v1/completions request, ready for the engine."""

    chat: bool
    model: str | None  # None: the served model
    prompts: tuple[str | list[int] | list[dict], ...]  # completion texts or token ids; chat: one, its messages
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool = False  # and continuous_usage_stats (vLLM's): every chunk with the usage so far
    logprobs: bool = False  # return logprobs (params.logprobs holds how many alternatives)
    echo: bool = False  # completions: each choice's text (and logprobs) starts with its prompt's
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (the engine's one token is dropped)
    prompt_param: str = ""  # the field that holds the prompt, named in errors about it (default: prompt / messages)
    forced_call: ForcedCall | None = None  # chat: the tool call tool_choice forces (server/tools.py)
    auto_calls: AutoCalls | None = None  # chat, tool_choice "auto": the calls the model may write (server/tools.py)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each prompt's last this many tokens (-1: the context)
    template_kwargs: dict | None = None  # chat, vLLM's: the chat template's variables and add_generation_prompt
    split_reasoning: bool = False  # chat: the reply's <think> text goes to reasoning_content (reasoning.py)
    harmony: bool = False  # chat: the model writes harmony (gpt-oss): its reply is read by channel (harmony.py)
    grammar_param: str | None = None  # the field whose grammar params.grammar is (named in the engine's refusals)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs: the prompt tokens' logprobs go in the answer
    settings: dict | None = None  # Responses: the request's settings its response object repeats (instructions, ...)

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools the chat template shows the model (forced or "auto" calls), else None."""
        calls = self.forced_call or self.auto_calls
        return list(calls.tools) if calls is not None else None
