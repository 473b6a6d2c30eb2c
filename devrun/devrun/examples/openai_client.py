"""Talk to a Colibri server with the official OpenAI Python SDK: a chat completion, then the same one streamed.

    colibri serve --model DIR --port 8000            # add --api-key KEY to require a key
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 [--api-key KEY] [--prompt TEXT]
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=os.environ.get("COLIBRI_API_KEY", "none"))
    parser.add_argument("--prompt", default="Write a haiku about hummingbirds.")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": args.prompt}]

    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                           temperature=0)
    print(f"[{model}] {reply.choices[0].message.content!r} ({reply.choices[0].finish_reason}, "
          f"{reply.usage.completion_tokens} tokens)")

    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            print(f"\n[streamed {chunk.usage.completion_tokens} tokens]")


if __name__ == "__main__":
    main()
