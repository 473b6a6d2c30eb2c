"""Embed the engine in an asyncio program: stream two completions concurrently and print the engine's stats.

    python examples/embedded_engine.py [MODEL_FOLDER] [--device cpu]

The engine runs its steps in its own thread, so this program's event loop stays free while tokens are computed;
the heartbeat task below keeps ticking during generation to show it.
"""

from __future__ import annotations

import argparse
import asyncio

from colibri_stream.async_engine import AsyncEngine, run
from colibri_stream.request import SamplingParams


async def stream_one(engine: AsyncEngine, name: str, prompt: str | list[dict], params: SamplingParams) -> None:
    async for out in engine.generate(prompt, params):
        print(f"[{name}] {out.text!r}", flush=True)
        if out.finished:
            print(f"[{name}] finished: {out.finish_reason}, {out.prompt_tokens} prompt + "
                  f"{out.completion_tokens} completion tokens")


async def heartbeat() -> None:
    while True:
        await asyncio.sleep(0.25)
        print("[heartbeat] the event loop is responsive", flush=True)


async def main(folder: str | None, device: str) -> None:
    async with AsyncEngine.from_pretrained(folder, device=device, max_batch_size=8) as engine:
        beat = asyncio.create_task(heartbeat())
        params = SamplingParams(max_tokens=48, temperature=0.7, seed=0)
        chat = [{"role": "user", "content": "Name three rivers."}] if engine.tokenizer.has_chat_template else None
        await asyncio.gather(
            stream_one(engine, "text", "Once upon a time", params),
            stream_one(engine, "chat", chat or "Three rivers:", params),
        )
        beat.cancel()
        print(engine.stats())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None,
                        help="a Colibri model folder (see `colibri export`); default: the model shipped with Colibri")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu"))
    args = parser.parse_args()
    run(main(args.model, args.device))
