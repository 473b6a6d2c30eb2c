"""An agent loop against a Colibri server with the official OpenAI SDK: the model may call a local function
(tool_choice "auto"), the loop runs it and sends the result back until the model answers in text.

"auto" needs a model whose chat template teaches a tool-call syntax the server reads (Qwen3-MoE's `<tool_call>`
blocks, Mistral's `[TOOL_CALLS]`); the shipped default model's template teaches `<tool_call>` blocks, but the model
is too small to use them (and to fit --max-tokens 2048), so export one first:

    colibri export ./Qwen3-30B-A3B ./qwen3-30b-a3b     # a downloaded Hugging Face checkpoint folder
    colibri serve --model ./qwen3-30b-a3b --port 8000
    python examples/tool_calling.py --base-url http://127.0.0.1:8000/v1 [--api-key KEY]

A thinking model's reasoning comes back apart from its answer (`reasoning_content`), printed here as it goes.
"""

from __future__ import annotations

import argparse
import json
import os

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "python_version_of",
    "description": "The Python version in which a standard library module first appeared",
    "parameters": {"type": "object", "properties": {"module": {"type": "string"}}, "required": ["module"]}}}]
FIRST_SEEN = {"asyncio": "3.4", "dataclasses": "3.7", "graphlib": "3.9", "tomllib": "3.11", "zoneinfo": "3.9"}


def python_version_of(module: str) -> str:
    return FIRST_SEEN.get(module, "unknown")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=os.environ.get("COLIBRI_API_KEY", "none"))
    parser.add_argument("--question", default="Which is older in the standard library, tomllib or graphlib?")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=2048, help="per reply (thinking included)")
    args = parser.parse_args(argv)

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    messages: list[dict] = [{"role": "user", "content": args.question}]
    for _ in range(args.max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                               max_tokens=args.max_tokens)
        message = reply.choices[0].message
        reasoning = (message.model_extra or {}).get("reasoning_content")
        if reasoning:
            print(f"[thinking] {reasoning.strip()[:300]}")
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(message.content)
            return
        for call in message.tool_calls:
            result = python_version_of(**json.loads(call.function.arguments))
            print(f"[tool] {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(f"no answer after {args.max_turns} turns")


if __name__ == "__main__":
    main()
