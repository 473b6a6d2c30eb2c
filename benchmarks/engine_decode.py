"""Decode through the engine: what `colibri serve` gets per step, against the same decode graph replayed alone.

For each shape (random weights of the published dimensions, fewer layers, experts resident) and batch size B, an
EngineCore (the scheduler, the runner with its CUDA graphs, the sampler, detokenization) runs B greedy requests of
PROMPT random tokens, each generating NEW tokens (ignore_eos). Reported, from the steps that only decode (the
prefill step excluded; a warm-up round first, so the bucket's graph is captured):
  engine_tok_s      B tokens per decode step over the step's wall time through `EngineCore.step`
  graph_replay_us   the bucket's decode graph replayed back to back (the device's time alone, as decode.py)
  engine_step_us    the mean decode step, and its phases from the step timer (a separate round: the timer on)
  host_us           the step minus its forward phase (the wait for the step's ids): the host's work per step,
                    which with async scheduling runs while the device computes the next step
  engine_sync_tok_s the same engine with async scheduling off (each step's ids read before the next is
                    launched), in rounds alternating with the async ones
  sampled_tok_s     sampled requests (temperature 1, seeded: the OpenAI default), launched ahead, each token drawn
                    in the decode graph; sampled_sync_tok_s: read step by step, drawn on the device after the
                    graph; sampled_host_walk_tok_s: read step by step, walked on the host (alternating rounds)
so `engine_tok_s / graph_tok_s` is the share of the device's speed that a served request sees at batch B.

    python benchmarks/engine_decode.py --out benchmarks/results/engine_decode_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from colibri_stream.tokenizer import Tokenizer
from conditions import require_gpu
from decode import graph_replay_seconds, log, machine

from colibri_stream.config import CacheConfig, EngineConfig, SchedulerConfig
from colibri_stream.engine import EngineCore
from colibri_stream.request import SamplingParams
from colibri_stream.synthetic import synthetic_model

PROMPT = 32  # prompt tokens per request
HOST_PHASES = ("schedule", "prepare", "forward", "sample", "update", "detokenize")


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """A tokenizer of `vocab_size` words t0 .. t{V-1} (t0 the end of sequence): synthetic models have no vocabulary,
    and detokenization only needs every id to decode."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import models, pre_tokenizers

    backend = BackendTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, {"eos_token": "t0"}, {}, [0])


class EngineRun:
    """One engine over a synthetic model, sized for `max_batch` sequences of PROMPT + `new` tokens."""

    def __init__(self, shape: str, layers: int, device: str, max_batch: int, new: int):
        self.model = synthetic_model(shape, num_layers=layers, device=device)
        vocab = self.model.config.vocab_size
        config = EngineConfig(model=shape, device=device,
                              scheduler=SchedulerConfig(max_batch_size=max_batch, max_seq_len=PROMPT + new + 16),
                              cache=CacheConfig(enable_prefix_caching=False))
        self.core = EngineCore(self.model, word_tokenizer(vocab), config)
        self.new, self.vocab = new, vocab
        self.rounds = 0
        self.records = []  # StepRecords of the rounds run with the timer on
        self.core.timer.add_sink(self.records.append)
        self.core.timer.enabled = False

    def decode_steps(self, batch: int, timed_phases: bool = False, sampled: bool = False
                     ) -> list[tuple[float, dict | None]]:
        """Run `batch` requests to the end (greedy, or `sampled`: the OpenAI default, temperature 1 over the whole
        vocabulary, seeded); (wall seconds, phase seconds with `timed_phases` or None) of every step that only
        decoded."""
        rng = np.random.default_rng(self.rounds)
        for i in range(batch):
            prompt = rng.integers(1, self.vocab, PROMPT).tolist()
            params = SamplingParams(max_tokens=self.new, temperature=1.0 if sampled else 0.0, ignore_eos=True,
                                    seed=i if sampled else None)
            self.core.add_request(f"r{self.rounds}-{i}", prompt, params)
        self.rounds += 1
        steps = []
        self.records.clear()
        self.core.timer.enabled = timed_phases
        while self.core.has_unfinished():
            start = time.perf_counter()
            outputs = self.core.step()
            seconds = time.perf_counter() - start
            stats = self.core.stats()
            if stats.last_step_tokens == len(outputs) == batch:  # one new token for every sequence
                steps.append(seconds)
        self.core.timer.enabled = False
        phases = [r.phase_seconds() for r in self.records if r.args.get("tokens") == r.args.get("seqs") == batch]
        return [(s, phases[i] if i < len(phases) else None) for i, s in enumerate(steps)]

    def graph_replay_seconds(self, batch: int, replays: int = 64) -> float | None:
        """Seconds per replay of the decode graph of `batch`'s bucket, back to back (None: no graph)."""
        graphs = self.core.runner.graphs
        if graphs is None:
            return None
        size = next(s for s in graphs.sizes if s >= batch)
        graph = graphs._graphs.get(size)
        return None if graph is None else graph_replay_seconds(graph, replays)


def run_batch(run: EngineRun, batch: int, rounds: int = 2) -> dict:
    run.decode_steps(batch)  # warm: captures the bucket's graph
    plain, sync = [], []
    default = run.core.async_scheduling
    for _ in range(rounds):  # async scheduling as configured, and off, in turn (switched with nothing in flight)
        plain += [s for s, _ in run.decode_steps(batch)]
        run.core.async_scheduling = False
        sync += [s for s, _ in run.decode_steps(batch)]
        run.core.async_scheduling = default
    timed = run.decode_steps(batch, timed_phases=True)
    phases = [p for _, p in timed if p is not None]
    mean_phases = {name: 1e6 * statistics.mean(p.get(name, 0.0) for p in phases) for name in HOST_PHASES} \
        if phases else {}
    step = statistics.median(plain)
    replay = run.graph_replay_seconds(batch)
    record = {"batch": batch, "decode_steps": len(plain), "engine_tok_s": batch / step,
              "engine_step_us": 1e6 * step, "graph_replay_us": None if replay is None else 1e6 * replay,
              "graph_tok_s": None if replay is None else batch / replay,
              "engine_of_graph": None if replay is None else replay / step,
              "engine_sync_tok_s": batch / statistics.median(sync), "async_scheduling": run.core.async_scheduling,
              "timed_step_us": 1e6 * statistics.median(s for s, _ in timed), "phases_us": mean_phases,
              "host_us": (1e6 * statistics.median(s for s, _ in timed) - mean_phases["forward"])
              if mean_phases else None}
    return record


def run_sampled(run: EngineRun, batch: int, rounds: int = 2) -> dict:
    """The same engine on sampled requests (temperature 1, no top-k or top-p), three ways in alternating rounds:
    launched ahead with each token drawn in the decode graph (the default), read step by step with the draw on the
    device (DeviceLogits.whole_vocabulary_draws), and read step by step with the host walking copied candidates."""
    from colibri_stream.backends.cupy_sampling import DeviceLogits

    run.decode_steps(batch, sampled=True)  # warm
    ahead, on_device, on_host = [], [], []
    draws, default = DeviceLogits.whole_vocabulary_draws, run.core.async_scheduling
    for _ in range(rounds):
        ahead += [s for s, _ in run.decode_steps(batch, sampled=True)]
        run.core.async_scheduling = False
        on_device += [s for s, _ in run.decode_steps(batch, sampled=True)]
        DeviceLogits.whole_vocabulary_draws = lambda self, rows, temperature, uniform: None
        try:
            on_host += [s for s, _ in run.decode_steps(batch, sampled=True)]
        finally:
            DeviceLogits.whole_vocabulary_draws = draws
            run.core.async_scheduling = default
    return {"sampled_tok_s": batch / statistics.median(ahead),
            "sampled_sync_tok_s": batch / statistics.median(on_device),
            "sampled_host_walk_tok_s": batch / statistics.median(on_host)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["mixtral-8x7b", "qwen3-30b-a3b"])
    parser.add_argument("--layers", nargs="+", type=int, default=[8, 16], help="layers of each shape")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--new", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--out", default="benchmarks/results/engine_decode_h200.json")
    args = parser.parse_args(argv)
    require_gpu()
    records = []
    for shape, layers in zip(args.shapes, args.layers):
        run = EngineRun(shape, layers, "cuda", max(args.batches), args.new)
        for batch in args.batches:
            record = dict(machine(), commit=os.environ.get("COLIBRI_COMMIT"),
                          bench="engine_decode", shape=shape, layers=layers, prompt=PROMPT, new_tokens=args.new,
                          **run_batch(run, batch), **run_sampled(run, batch))
            records.append(record)
            replay = record["graph_replay_us"]
            log(f"{shape} ({layers} layers) b{batch}: engine {record['engine_tok_s']:.0f} tok/s "
                f"(without async scheduling {record['engine_sync_tok_s']:.0f}), step "
                f"{record['engine_step_us']:.0f} us; graph alone "
                + ("-" if replay is None else f"{replay:.0f} us ({record['engine_of_graph']:.0%} of it)")
                + "; phases (us): " + ", ".join(f"{k} {v:.0f}" for k, v in record["phases_us"].items())
                + f"; sampled (temperature 1): {record['sampled_tok_s']:.0f} tok/s launched ahead, "
                  f"{record['sampled_sync_tok_s']:.0f} step by step, drawn on the device, "
                  f"{record['sampled_host_walk_tok_s']:.0f} walked on the host")
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)
        del run
    return 0


if __name__ == "__main__":
    sys.exit(main())
