"""Step timings: the StepTimer's nesting and clocks, and the Chrome trace of real engine steps."""

from __future__ import annotations

import json
from collections import defaultdict

from colibri_stream.cli import main
from colibri_stream.engine import EngineCore
from colibri_stream.request import SamplingParams
from colibri_stream.timing import PHASES, Clock, StepRecord, StepTimer


def nested_step(timer: StepTimer) -> None:
    with timer.phase("step"):
        with timer.phase("schedule"):
            pass
        with timer.phase("forward"):
            for _ in range(3):
                with timer.device_phase("attention"):
                    pass
                with timer.device_phase("experts"):
                    pass


def test_disabled_timer_records_nothing():
    timer = StepTimer()
    nested_step(timer)  # no sink: disabled
    records: list[StepRecord] = []
    timer.add_sink(records.append)
    timer.enabled = False
    nested_step(timer)
    assert records == []
    timer.enabled = True
    nested_step(timer)
    assert len(records) == 1 and records[0].index == 0


def test_record_nests_and_sums_layers():
    timer = StepTimer()
    records: list[StepRecord] = []
    timer.add_sink(records.append)
    timer.annotate(tokens=5)
    nested_step(timer)
    nested_step(timer)
    first, second = records
    assert (first.index, second.index) == (0, 1) and first.args == {"tokens": 5} and second.args == {}
    spans = first.spans
    assert [(s.name, s.depth) for s in spans] == [("step", 0), ("schedule", 1), ("forward", 1)] + \
        [("attention", 2), ("experts", 2)] * 3
    step, forward = spans[0], spans[2]
    assert first.duration == step.end - step.start > 0
    assert all(step.start <= s.start <= s.end <= step.end for s in spans)
    assert all(forward.start <= s.start <= s.end <= forward.end for s in spans[3:])
    totals = first.phase_seconds()
    assert set(totals) == {"schedule", "forward", "attention", "experts"}
    assert totals["attention"] == sum(s.end - s.start for s in spans if s.name == "attention")


class CountingClock(Clock):
    """A device clock whose marks are counters, converted to seconds (10 ms a tick) after the step."""

    track = "device"

    def __init__(self):
        self.ticks = 0

    def mark(self) -> int:
        self.ticks += 1
        return self.ticks

    def seconds(self, marks: list[int]) -> list[float]:
        return [1000.0 + 0.01 * m for m in marks]


def test_device_clock_marks_become_seconds_after_the_step():
    timer = StepTimer(CountingClock())
    records: list[StepRecord] = []
    timer.add_sink(records.append)
    nested_step(timer)
    spans = records[0].spans
    device = [s for s in spans if s.track == "device"]
    assert [s.name for s in device] == ["attention", "experts"] * 3
    assert [(round(s.start, 6), round(s.end, 6)) for s in device[:2]] == [(1000.01, 1000.02), (1000.03, 1000.04)]
    assert {s.track for s in spans if s.name in ("step", "schedule", "forward")} == {"host"}


def test_engine_steps_report_every_phase(tiny_model_dir):
    core = EngineCore.from_pretrained(str(tiny_model_dir), device="cpu")
    records: list[StepRecord] = []
    core.timer.add_sink(records.append)
    core.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    while core.has_unfinished():
        core.step()
    assert len(records) == 4 and records[0].args == {"tokens": 37, "seqs": 1}
    layers = core.model_config.num_layers
    for record in records:
        names = [s.name for s in record.spans]
        assert set(names) <= set(PHASES)
        assert names.count("attention") == names.count("routing") == names.count("experts") == layers
        assert {"schedule", "prepare", "forward", "sample", "update", "detokenize"} <= set(names)
    assert 0 < records[-1].duration <= core.stats().last_step_time  # the engine's own clock is around the timer's


def test_trace_file_nests_and_covers_each_step(tiny_model_dir, tmp_path, capsys):
    trace = tmp_path / "generate.json"
    assert main(["generate", "--model", str(tiny_model_dir), "--device", "cpu", "--prompt", "hello world",
                 "--max-tokens", "6", "--trace-file", str(trace)]) == 0
    capsys.readouterr()
    events = json.loads(trace.read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert set(tracks.values()) == {"host"}
    complete = [e for e in events if e["ph"] == "X"]
    steps = [e for e in complete if e["name"] == "step"]
    assert len(steps) == 6 and [s["args"]["step"] for s in steps] == list(range(6))
    by_step = defaultdict(list)
    for event in complete:
        if event["name"] != "step":
            owner = [s for s in steps if s["ts"] <= event["ts"] and event["ts"] + event["dur"] <= s["ts"] + s["dur"]]
            assert len(owner) == 1, event  # every phase lies inside exactly one step
            by_step[owner[0]["args"]["step"]].append(event)
    for step in steps:
        phases = sorted(by_step[step["args"]["step"]], key=lambda e: e["ts"])
        top = [e for e in phases if PHASES[e["name"]] == "step"]
        assert [e["name"] for e in top] == ["schedule", "prepare", "forward", "sample", "update", "detokenize"]
        for earlier, later in zip(top, top[1:]):
            assert earlier["ts"] + earlier["dur"] <= later["ts"]  # siblings do not overlap
        forward = top[2]
        for part in (e for e in phases if PHASES[e["name"]] == "forward"):
            assert forward["ts"] <= part["ts"] and part["ts"] + part["dur"] <= forward["ts"] + forward["dur"]
        assert sum(e["dur"] for e in top) >= 0.8 * step["dur"]  # the phases cover the step


def test_tiered_store_reads_are_phases_of_the_experts(tmp_path, tiny_model_dir):
    """With a host tier smaller than the experts, demand reads of experts.bin show up as expert_load_disk phases
    nested in `experts`."""
    import subprocess
    import sys

    import orjson

    trace = tmp_path / "trace.json"
    done = subprocess.run([sys.executable, "-m", "colibri_stream", "generate", "--model", str(tiny_model_dir),
                           "--prompt", "hello", "--max-tokens", "4", "--l2-cache-size", "200KiB",
                           "--trace-file", str(trace)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = orjson.loads(trace.read_bytes())
    events = data["traceEvents"] if isinstance(data, dict) else data
    spans = [e for e in events if e.get("ph") == "X"]
    loads = [e for e in spans if e["name"] == "expert_load_disk"]
    experts = [e for e in spans if e["name"] == "experts"]
    assert loads and all(
        any(x["ts"] <= e["ts"] and e["ts"] + e["dur"] <= x["ts"] + x["dur"] + 1 for x in experts) for e in loads
    )
