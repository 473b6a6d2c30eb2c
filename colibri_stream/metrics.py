"""Prometheus metrics of a serving process: requests, tokens, latencies, step timings, the engine's queue and KV cache.

Each server owns a registry (several servers can live in one process, as in tests). Request-side figures are
observed as responses are produced; the engine's state (queue depth, running requests, KV blocks, steps) is read
from `engine.stats()` at scrape time, so it is always current and costs nothing between scrapes. Step timings
arrive from the engine's step thread as `StepRecord`s (`observe_step`): `colibri_step_seconds` per step and
`colibri_step_phase_seconds{phase}` per phase and step (the names in `timing.PHASES`).

What is observed once per streamed output (its tokens, their latencies) only counts, in plain Python numbers that
become metric families at scrape time (`TokenCollector`): prometheus_client's Counter and Histogram take a lock for
every update, a cost that would be paid per token and stream on the event loop.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .timing import StepRecord

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                    5.0, 10.0, 20.0, 40.0, 80.0)
_STEP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0, 10.0)
_LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class EngineCollector(Collector):
    """Reads the engine's scheduler and cache state when Prometheus scrapes."""

    def __init__(self, engine: Any):
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        per_replica = getattr(self._engine, "replica_stats", None)  # data-parallel replicas (`replicas.py`)
        if per_replica is None:
            yield from self._families(self._engine.stats(), [], [])
            return
        health = GaugeMetricFamily("colibri_replica_healthy", "Whether a data-parallel replica is healthy (1) or "
                                   "not (0: its process died, or its last step failed)", labels=["replica"])
        for index, healthy in enumerate(self._engine.replica_health()):
            health.add_metric([str(index)], float(healthy))
        yield health
        families: dict[str, Metric] = {}
        for index, stats in enumerate(per_replica()):
            for family in self._families(stats, ["replica"], [str(index)]):
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()

    @staticmethod
    def _families(stats: Any, labels: list[str], values: list[str]) -> Iterator[Metric]:
        """One engine's families, its samples labelled `labels` = `values` (none for a single engine)."""
        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        gauges = {
            "colibri_num_requests_waiting": ("Sequences waiting to be scheduled (queue depth)", stats.num_waiting),
            "colibri_num_requests_running": ("Sequences scheduled in the running batch", stats.num_running),
            "colibri_kv_blocks_total": ("KV cache blocks in the pool", stats.kv_blocks_total),
            "colibri_kv_blocks_used": ("KV cache blocks held by sequences", stats.kv_blocks_used),
            "colibri_kv_blocks_free": ("KV cache blocks free (cached blocks no sequence holds included)",
                                       stats.kv_blocks_total - stats.kv_blocks_used),
            "colibri_kv_blocks_cached": ("KV cache blocks holding a prefix-cache entry", stats.kv_blocks_cached),
            "colibri_kv_sliding_blocks_total": ("KV cache blocks in the sliding-window layers' pool (0: none)",
                                                stats.sliding_blocks_total),
            "colibri_kv_sliding_blocks_used": ("Sliding-window layers' KV blocks held by sequences",
                                               stats.sliding_blocks_used),
            "colibri_last_step_seconds": ("Duration of the engine's last step", stats.last_step_time),
            "colibri_last_step_tokens": ("Tokens the engine's last step computed", stats.last_step_tokens),
        }
        for name, (doc, value) in gauges.items():
            yield gauge(name, doc, value)
        yield counter("colibri_engine_steps", "Engine steps run", stats.num_steps)
        yield counter("colibri_engine_steps_launched_ahead", "Engine steps launched before the tokens of the step "
                      "before were read (async scheduling)", stats.num_steps_launched_ahead)
        yield counter("colibri_engine_preemptions", "Sequences preempted for lack of KV blocks",
                      stats.num_preemptions)
        yield counter("colibri_engine_generated_tokens", "Tokens the engine has sampled", stats.num_generated_tokens)
        yield counter("colibri_engine_aborted_sequences", "Sequences aborted before they finished (the client left "
                      "or cancelled, or the server shut down)", stats.num_aborted)
        prefill = CounterMetricFamily("colibri_prefill_tokens", "Tokens of admitted sequences (prompts; after a "
                                      "preemption the output so far too) by whether the prefix cache served them or "
                                      "the model computed them", labels=["source", *labels])
        prefill.add_metric(["cached", *values], stats.prefix_cache_hit_tokens)
        prefill.add_metric(["computed", *values], stats.prefill_computed_tokens)
        yield prefill


class ExpertStoreCollector(Collector):
    """Reads the expert store's counters (`engine.store_stats()`) when Prometheus scrapes; nothing when every
    expert is resident."""

    def __init__(self, engine: Any):
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.store_stats()
        if stats is None:
            return
        per_tier = {
            "hits": "Expert requests a tier served",
            "misses": "Expert requests a tier passed to the tier below",
            "bytes_read": "Bytes of expert blocks moved out of a tier towards the compute",
        }
        for field, doc in per_tier.items():
            family = CounterMetricFamily(f"colibri_expert_tier_{field}", doc, labels=["tier"])
            for tier, counters in stats.tiers.items():
                family.add_metric([tier], getattr(counters, field))
            yield family
        yield CounterMetricFamily("colibri_expert_stall_seconds", "Time steps waited for expert loads",
                                  value=stats.stall_seconds)
        yield CounterMetricFamily("colibri_expert_prefetch_bytes", "Bytes of expert blocks loaded ahead",
                                  value=stats.prefetch_bytes)
        yield CounterMetricFamily("colibri_expert_prefetch_wasted_bytes",
                                  "Bytes loaded ahead that the step they were loaded for did not use",
                                  value=stats.prefetch_wasted_bytes)
        yield CounterMetricFamily("colibri_expert_load_errors", "Expert blocks that failed their checksum",
                                  value=stats.load_errors)
        computed = CounterMetricFamily("colibri_expert_computed", "Routed expert computations (one per expert and "
                                       "step) by where they ran", labels=["device"])
        computed.add_metric(["gpu"], stats.compute.gpu_experts)
        computed.add_metric(["cpu"], stats.compute.cpu_experts)
        yield computed
        yield CounterMetricFamily("colibri_expert_split", "Routed experts cut by rows between the CPU and the GPU "
                                  "(each also counted once per device in colibri_expert_computed)",
                                  value=stats.compute.split_experts)
        yield CounterMetricFamily("colibri_cpu_expert_seconds", "Wall time of experts computed on the CPU",
                                  value=stats.compute.cpu_seconds)
        yield CounterMetricFamily("colibri_cpu_expert_bytes_read", "Expert weight bytes the CPU read from host memory",
                                  value=stats.compute.cpu_bytes_read)
        recall = GaugeMetricFamily("colibri_expert_prefetch_recall",
                                   "Predicted and used over used experts, per MoE layer rank", labels=["layer"])
        for rank, value in enumerate(stats.recall_per_layer()):
            if value is not None:
                recall.add_metric([str(rank)], value)
        yield recall


class _Histogram:
    """Observations counted into the buckets of `bounds` (upper bounds, ascending; the last bucket past them all)
    and summed; a metric family's samples when scraped."""

    __slots__ = ("bounds", "les", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.les = [*map(floatToGoString, bounds), "+Inf"]
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, observations up to it) per bucket, as a metric family takes them."""
        return list(zip(self.les, itertools.accumulate(self.counts)))

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc)
        family.add_metric([], self.cumulative(), self.sum)
        return family


class TokenCollector(Collector):
    """What the streamed outputs carried: prompt and generated tokens, time to first token, inter-token latency.

    `observe` runs on the event loop for every RequestOutput, so it only counts; it needs no lock, as the event loop
    both updates and scrapes it."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = _Histogram(_LATENCY_BUCKETS)
        self.itl = _Histogram(_LATENCY_BUCKETS)

    def observe(self, output: Any) -> None:
        if output.time_to_first_token is not None:
            self.ttft.observe(output.time_to_first_token)
            if output.index == 0:  # once per request
                self.prompt_tokens += output.prompt_tokens
        for latency in output.inter_token_latencies:
            self.itl.observe(latency)
        self.generation_tokens += len(output.token_ids)

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("colibri_prompt_tokens", "Prompt tokens of admitted requests",
                                  value=self.prompt_tokens)
        yield CounterMetricFamily("colibri_generation_tokens", "Tokens sent to clients", value=self.generation_tokens)
        yield self.ttft.family("colibri_time_to_first_token_seconds", "Request arrival to its first token")
        yield self.itl.family("colibri_inter_token_latency_seconds", "Time between a sequence's tokens")


class StepTimingCollector(Collector):
    """The engine's step timings as Prometheus histograms: `colibri_step_seconds` and
    `colibri_step_phase_seconds{phase}` (one observation per step and phase, the model's layers summed).

    `observe` runs in the engine's step thread and only counts, a bisect and two additions per histogram;
    prometheus_client's Histogram takes a lock for every counter it touches, a cost paid a dozen times a step. The
    counts become histograms when Prometheus scrapes.
    """

    def __init__(self, bounds: tuple[float, ...] = _STEP_BUCKETS):
        self._bounds = bounds
        self._step = _Histogram(bounds)
        self._phases: dict[str, _Histogram] = {}

    def observe(self, record: StepRecord) -> None:
        self._step.observe(record.duration)
        for phase, seconds in record.phase_seconds().items():
            histogram = self._phases.get(phase)
            if histogram is None:
                histogram = self._phases[phase] = _Histogram(self._bounds)
            histogram.observe(seconds)

    def collect(self) -> Iterator[Metric]:
        yield self._step.family("colibri_step_seconds", "Duration of engine steps")
        phases = HistogramMetricFamily("colibri_step_phase_seconds",
                                       "Time one engine step spent in a phase (summed over the model's layers)",
                                       labels=["phase"])
        for phase, histogram in list(self._phases.items()):  # a copy: the step thread may add a phase meanwhile
            phases.add_metric([phase], histogram.cumulative(), histogram.sum)
        yield phases


class ServerMetrics:
    """The metrics of one server; `render()` is the body of GET /metrics."""

    def __init__(self, engine: Any):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("colibri_requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=r)
        self.finished = Counter("colibri_request_finished", "Finished sequences by finish reason",
                                ["finish_reason"], registry=r)
        self.tokens = TokenCollector()
        r.register(self.tokens)
        self.e2e = Histogram("colibri_request_latency_seconds", "Request arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.loop_lag = Histogram("colibri_event_loop_lag_seconds", "How late the event loop wakes a timer",
                                  buckets=_LAG_BUCKETS, registry=r)
        self.step_timings = StepTimingCollector()
        r.register(self.step_timings)
        r.register(EngineCollector(engine))
        r.register(ExpertStoreCollector(engine))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def observe(self, output: Any) -> None:
        """Count one RequestOutput's tokens and latencies (measured by the engine when it sampled them)."""
        self.tokens.observe(output)
        if output.finished:
            self.finished.labels(output.finish_reason).inc()

    def observe_step(self, record: StepRecord) -> None:
        """Count one engine step's duration and phases (a step sink: called in the engine's step thread)."""
        self.step_timings.observe(record)

    async def watch_event_loop(self, interval: float = 0.05) -> None:
        """Run forever, observing how much later than asked each `sleep(interval)` wakes: the loop's lag."""
        while True:
            start = time.perf_counter()  # not loop.time(): uvloop's clock has millisecond resolution
            await asyncio.sleep(interval)
            self.loop_lag.observe(max(0.0, time.perf_counter() - start - interval))
