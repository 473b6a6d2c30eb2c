"""`colibri bench` end to end: against the real server with the tiny model (its step metrics and trace too), and
against a minimal OpenAI-compatible stub that has neither usage nor /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections import defaultdict

import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from test_server import LiveServer, request

from colibri_stream.bench import to_table
from colibri_stream.cli import main
from colibri_stream.timing import PHASES

NUM_REQUESTS, OUTPUT_LEN, INPUT_LEN = 16, 8, 12
FIELDS = {"url", "model", "endpoint", "num_requests", "concurrency", "request_rate", "output_len", "duration_s",
          "completed", "failed", "errors", "request_throughput", "output_token_throughput", "total_token_throughput",
          "prompt_tokens", "output_tokens", "requests_without_usage", "ttft_ms", "tpot_ms", "itl_ms",
          "e2e_latency_ms", "server"}
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms")


def run_bench(*args: str) -> str:
    """`colibri bench` in this thread; returns what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "--quiet", *args]) == 0
    return out.getvalue()


def counters(server: LiveServer) -> dict[str, float]:
    _, _, raw = request(server, "GET", "/metrics", key=None)
    return {s.name: s.value for family in text_string_to_metric_families(raw.decode()) for s in family.samples
            if not s.labels}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """One bench run against the real server (traced), then the server closed: the report, the server's own token
    counters over the run, the trace and the plot."""
    folder = tmp_path_factory.mktemp("bench")
    trace, png = folder / "serve-trace.json", folder / "bench.png"
    server = LiveServer(tiny_model_dir, dict(max_batch_size=8, max_seq_len=512), trace_file=str(trace))
    try:
        before = counters(server)
        report = json.loads(run_bench("--url", server.url, "--num-requests", str(NUM_REQUESTS), "--concurrency", "4",
                                      "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--ignore-eos",
                                      "--output-format", "json", "--plot", str(png)))
        after = counters(server)
    finally:
        server.close()
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    return report, delta, trace, png


def check_latencies(report: dict) -> None:
    for key in LATENCIES:
        figures = report[key]
        assert set(figures) == {"mean", "p50", "p90", "p99"}, key
        assert 0 < figures["p50"] <= figures["p90"] <= figures["p99"], key
        assert figures["mean"] > 0, key
    assert report["ttft_ms"]["p99"] <= report["e2e_latency_ms"]["p99"]


def test_bench_reports_every_field(served):
    report = served[0]
    assert set(report) == FIELDS
    assert (report["model"], report["endpoint"], report["concurrency"]) == ("tiny-mixtral", "chat", 4)
    assert (report["completed"], report["failed"], report["errors"]) == (NUM_REQUESTS, 0, {})
    assert report["duration_s"] > 0 and report["requests_without_usage"] == 0
    assert report["request_throughput"] == pytest.approx(NUM_REQUESTS / report["duration_s"])
    assert report["output_token_throughput"] == pytest.approx(report["output_tokens"] / report["duration_s"])
    assert report["total_token_throughput"] > report["output_token_throughput"] > 0
    check_latencies(report)


def test_bench_token_counts_match_the_server(served):
    report, delta, _, _ = served
    assert report["output_tokens"] == NUM_REQUESTS * OUTPUT_LEN == delta["colibri_generation_tokens_total"]
    assert report["prompt_tokens"] == delta["colibri_prompt_tokens_total"] >= NUM_REQUESTS * INPUT_LEN
    assert report["server"]["generated_tokens"] == report["output_tokens"]


def test_bench_reports_the_server_step_breakdown(served):
    report, delta, _, _ = served
    server = report["server"]
    assert server["steps"] == delta["colibri_engine_steps_total"] > 0
    assert 0 < server["busy_fraction"] <= 1.0 and server["tokens_per_step"] > 0
    phases = server["phases"]
    assert phases[0]["phase"] == "step" and phases[0]["share"] == 1.0 and phases[0]["ms_per_step"] > 0
    named = {(p["phase"], p["parent"]) for p in phases if p["phase"] != "other"}
    not_here = {"mlp", "expert_load_disk", "expert_load_wait", "expert_cpu"}  # all MoE, every expert resident
    assert named == {(name, parent) for name, parent in PHASES.items() if name not in not_here}
    for entry in phases:
        assert entry["ms_per_step"] >= -1e-9 and -1e-9 <= entry["share"] <= 1.0, entry
        if entry["phase"] != "other":
            assert entry["depth"] == (0 if entry["parent"] is None else 1 if entry["parent"] == "step" else 2)
    top = [p for p in phases if p["parent"] == "step"]
    assert sum(p["share"] for p in top) == pytest.approx(1.0)  # with the step's "other", the parts add up
    table = to_table(report)
    assert "TTFT" in table and "step phase" in table and "    attention" in table


def test_serve_trace_nests_within_steps(served):
    events = json.loads(served[2].read_text())  # complete JSON: the server closed it on shutdown
    complete = [e for e in events if e["ph"] == "X"]
    steps = sorted((e for e in complete if e["name"] == "step"), key=lambda e: e["ts"])
    assert len(steps) == served[0]["server"]["steps"]
    children = defaultdict(float)
    for event in complete:
        if PHASES[event["name"]] == "step":
            owners = [s for s in steps if s["ts"] <= event["ts"] and event["ts"] + event["dur"] <= s["ts"] + s["dur"]]
            assert len(owners) == 1
            children[owners[0]["args"]["step"]] += event["dur"]
    assert all(children[s["args"]["step"]] <= s["dur"] for s in steps)
    assert sum(children.values()) >= 0.8 * sum(s["dur"] for s in steps)


def test_bench_plot_is_a_png(served):
    png = served[3]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# ------------------------------------------------------------------------------------ a server that is not ours

def stub_app(prompts: list[str]) -> web.Application:
    """An OpenAI-compatible chat server in miniature: streams one word per chunk, no usage, no /metrics, and turns
    every fourth request away with 429."""
    calls = [0]

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def chat(http: web.Request) -> web.StreamResponse:
        body = await http.json()
        calls[0] += 1
        if calls[0] % 4 == 0:
            return web.json_response({"error": {"message": "busy", "type": "rate_limit_error"}}, status=429)
        prompts.append(body["messages"][0]["content"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(http)
        chunk = {"id": "x", "object": "chat.completion.chunk", "model": body["model"]}
        for i in range(body["max_tokens"]):
            await asyncio.sleep(0.002)
            delta = {"content": f"w{i} "}
            await response.write(b"data: " + orjson.dumps(dict(chunk, choices=[{"index": 0, "delta": delta}])) + b"\n\n")
        await response.write(b"data: " + orjson.dumps(dict(chunk, choices=[{"index": 0, "delta": {},
                                                                           "finish_reason": "length"}])) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.post("/v1/chat/completions", chat)])
    return app


def test_bench_against_a_foreign_server():
    prompts: list[str] = []

    async def go() -> dict:
        runner = web.AppRunner(stub_app(prompts))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        try:
            return json.loads(await asyncio.to_thread(
                run_bench, "--url", url, "--num-requests", "12", "--request-rate", "400", "--input-len", "7",
                "--output-len", "5", "--output-format", "json"))
        finally:
            await runner.cleanup()

    report = asyncio.run(go())
    assert set(report) == FIELDS and report["model"] == "stub-model" and report["server"] is None
    assert (report["completed"], report["failed"], report["errors"]) == (9, 3, {"429": 3})
    assert report["requests_without_usage"] == 9 and report["output_tokens"] == 9 * 5  # one token per chunk
    assert report["prompt_tokens"] == 0 and report["request_rate"] == 400 and report["concurrency"] is None
    assert len(prompts) == 9 and all(len(p.split()) == 7 for p in prompts)
    check_latencies(report)
