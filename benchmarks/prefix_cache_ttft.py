"""Time to first token of a resent long conversation, with and without prefix caching, through the engine.

A chat client resends the whole conversation every turn. Per round: a conversation of about `--prompt-tokens`
tokens (a system prompt and earlier turns) is sent once (its answer is not timed), then resent with one more user
turn, and that request's time from arrival to its first token is measured. Rounds use different conversations, so
each resend can only hit what its own first send left in the cache. The two settings alternate round by round on
two engines over the same shipped model, so both see the same machine load. Results go to
benchmarks/results/prefix_cache_ttft.json.

    python benchmarks/prefix_cache_ttft.py [--prompt-tokens 900] [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from conditions import machine

from colibri_stream.engine import EngineCore
from colibri_stream.request import SamplingParams

WORDS = ("the model routes every token to a few experts while the rest of the weights stay on the disk and the "
         "cache keeps what was computed before").split()


def conversation(core: EngineCore, round_: int, prompt_tokens: int) -> list[dict]:
    """System prompt and alternating turns, grown until the rendered prompt has about `prompt_tokens` tokens."""
    messages = [{"role": "system", "content": f"Session {round_}. You are a helpful assistant."}]
    i = 0
    while len(core.encode_prompt(messages)) < prompt_tokens:
        text = " ".join(WORDS[(round_ + i + j) % len(WORDS)] for j in range(24))
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        i += 1
    return messages


def ttft(core: EngineCore, request_id: str, prompt: list[int]) -> float:
    start = time.monotonic()
    core.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0), arrival_time=start)
    while core.has_unfinished():
        for out in core.step():
            if out.time_to_first_token is not None:
                first = out.time_to_first_token
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=900)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefix_cache_ttft.json")
    args = parser.parse_args()
    engines = {on: EngineCore.from_pretrained(None, device="cpu", enable_prefix_caching=on) for on in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    sizes = []
    for round_ in range(-1, args.rounds):  # round -1 warms both engines up and is not recorded
        for on, core in engines.items():
            messages = conversation(core, round_, args.prompt_tokens)
            ttft(core, f"send{round_}", core.encode_prompt(messages))
            resent = core.encode_prompt(messages + [{"role": "user", "content": "And then?"}])
            seconds = ttft(core, f"resend{round_}", resent)
            if round_ >= 0:
                times[on].append(seconds)
                sizes.append(len(resent))
    result = {
        "machine": machine(),
        "prompt_tokens_mean": statistics.mean(sizes),
        "rounds": args.rounds,
        "ttft_ms": {("cached" if on else "uncached"): {"median": 1e3 * statistics.median(t), "min": 1e3 * min(t),
                                                       "max": 1e3 * max(t)} for on, t in times.items()},
        "cached_tokens_per_resend": engines[True].stats().prefix_cache_hit_tokens / (args.rounds + 1),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
