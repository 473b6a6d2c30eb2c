"""Served against offline: `colibri serve` on loopback against the same engine driven directly, same prompts, same run.

For each model (`--models`: `default` is the model shipped with Colibri; a shape of `colibri_stream.synthetic.SHAPES`
such as `qwen3-30b-a3b` is a random bf16 model folder of `--layers` layers, written once under `--folder-root` with a
word-level tokenizer of its vocabulary; any other entry is a model folder's path) and each concurrency C
(`--concurrency`):

  offline_tok_s  `AsyncEngine.generate` driven by C concurrent consumers (a new request as soon as one ends), in a
                 fresh process, its step loop on a thread of that process: output tokens over the wall time from the
                 first request to the last one finished
  served_tok_s   `colibri serve` with the same engine options, in its own process (its steps in the engine process
                 it spawns; `--no-engine-process`: on its step thread; `engine_process` in the records), loaded
                 by `colibri bench`'s client
                 (`colibri_stream.bench`, run from this process) with C concurrent streamed /v1/completions requests:
                 the server's completion tokens over the same span, as the client saw it
  ratio          served_tok_s / offline_tok_s
  ttft_p50_ms, itl_p99_ms  the client's time to the first chunk with text, and the gaps between such chunks;
                 offline_ttft_p50_ms and offline_itl_p99_ms are the same figures for the engine's outputs
  server_loop_cpu_us_per_token  CPU time of the server's main thread (its event loop: HTTP, rendering, SSE
                 writes) during the timed run, per output token (Linux; None elsewhere)
  served_launched_ahead_fraction, offline_launched_ahead_fraction  the share of steps launched before the step
                 before was read (async scheduling): the others leave the device idle while the host works
  served_engine_cpu_us_per_step, offline_cpu_us_per_step  CPU time per engine step of the served engine process
                 (every thread; without --no-engine-process) and of the offline process (step thread and consumers)
  served_step_interval_ms, offline_step_interval_ms  the run's wall time over the engine steps it took: where the
                 server's work holds the GIL while the step thread waits for it, the served steps stretch

`--switch-interval` sets the GIL switch interval in both measured processes (the server is then started as
`python -c "...; sys.setswitchinterval(s); colibri_stream.cli.main(...)"`), to compare the event loop and the step
thread sharing the interpreter at other intervals than Python's 5 ms.

Prompts are `--input-len` random token ids, sent to the server as token ids, so the engine sees the same ids either
way; every request is greedy and asks for `--output-len` tokens with ignore_eos. Each concurrency is measured after
an unrecorded warm-up at that concurrency on other prompts (the batch sizes' CUDA graphs captured, caches warm), and
its timed prompts are new to the engine's prefix cache. The client's own CPU time is recorded
(`client_cpu_fraction`: near 1.0 would mean the client, not the server, set the pace). Records go to
benchmarks/results/serving_gpu.json (`--out`); the Markdown table is printed.

    python benchmarks/serving_gpu.py [--device cuda] [--models default qwen3-30b-a3b] [--concurrency 1 16 64]
        [--output-len 128] [--layers 8]
    python benchmarks/serving_gpu.py --device cpu --models default --concurrency 1 4 --output-len 16  # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

import numpy as np
from conditions import machine

RESULTS = Path(__file__).resolve().parent / "results" / "serving_gpu.json"
DEFAULT_MODEL = "default"
FIRST_PROMPT_ID = 16  # prompt ids are drawn from [FIRST_PROMPT_ID, vocab), past small vocabularies' special tokens
SERVER_STOP_SECONDS = 30.0  # after SIGTERM, then the server is killed


class BenchmarkError(RuntimeError):
    """A measurement that could not be made (a server that did not start, failed requests, a timeout)."""


# ---------------------------------------------------------------------------------------------------- models

def word_tokenizer_files(folder: Path, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json of a word-level vocabulary t0 .. t{V-1} (t0 the end of sequence):
    a synthetic model has no vocabulary, and serving it only needs every id to decode to some text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t0"}), encoding="utf-8")


def model_folder(name: str, layers: int, root: Path, device: str) -> tuple[Path, str]:
    """(folder, description) of a `--models` entry: the shipped model, a model folder, or a synthetic folder
    written if absent."""
    from colibri_stream.checkpoint import CONFIG_FILE, default_model_path
    from colibri_stream.synthetic import SHAPES, write_synthetic_folder

    if name == DEFAULT_MODEL:
        return default_model_path(), "the shipped default model (Qwen3-MoE shape, 8 layers, 32 experts top-4, int8)"
    if Path(name).is_dir():
        return Path(name), f"the model folder {name}"
    if name not in SHAPES:
        raise BenchmarkError(f"unknown model {name!r}: {DEFAULT_MODEL}, a model folder, or one of "
                             f"{', '.join(SHAPES)}")
    folder = root / f"{name}-{layers}-layers"
    if not (folder / CONFIG_FILE).is_file() or not (folder / "tokenizer.json").is_file():
        log(f"writing a random {name} model of {layers} layers to {folder}")
        config = write_synthetic_folder(folder, name, num_layers=layers,
                                        device="cuda" if device == "cuda" else "cpu")
        word_tokenizer_files(folder, config.vocab_size)
        os.sync()  # the page cache's write-back must not run beside the timed runs
    return folder, f"{name} shape, {layers} layers, random bf16 weights, word-level tokenizer"


def prompt_sets(vocab_size: int, concurrency: int, rounds: int, input_len: int) -> tuple[list, list]:
    """(warm-up prompts, timed prompts) of one concurrency: `concurrency` and `rounds * concurrency` lists of
    `input_len` token ids, drawn from the concurrency so every set is new to a prefix cache."""
    rng = np.random.default_rng(concurrency)
    warm_up, timed = (rng.integers(FIRST_PROMPT_ID, vocab_size, (count, input_len)).tolist()  # [count, input_len]
                      for count in (concurrency, rounds * concurrency))
    return warm_up, timed


# ---------------------------------------------------------------------------------------------------- offline

async def drive_engine(engine, prompts: list[list[int]], concurrency: int, output_len: int) -> dict:
    """Run every prompt through `engine.generate` with at most `concurrency` in flight; throughput and latencies."""
    from colibri_stream.request import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    limit = asyncio.Semaphore(concurrency)
    ttfts, gaps, tokens = [], [], [0]

    async def one(ids: list[int]) -> None:
        async with limit:
            sent = last = time.perf_counter()
            first = True
            async for out in engine.generate(ids, params):
                now = time.perf_counter()
                if first:
                    ttfts.append(now - sent)
                    first = False
                else:
                    gaps.append(now - last)
                last = now
                tokens[0] += len(out.token_ids)

    before, cpu = engine.stats(), time.process_time()
    start = time.perf_counter()
    await asyncio.gather(*(one(ids) for ids in prompts))
    duration = time.perf_counter() - start
    return {"tokens": tokens[0], "duration_s": duration, "tok_s": tokens[0] / duration,
            "cpu_s": time.process_time() - cpu,
            "steps": engine.stats().num_steps - before.num_steps,
            "steps_launched_ahead": engine.stats().num_steps_launched_ahead - before.num_steps_launched_ahead,
            "ttft_p50_ms": percentile_ms(ttfts, 50), "itl_p99_ms": percentile_ms(gaps, 99)}


def offline_worker(path: str, options: dict, runs: list[tuple[int, list, list]], output_len: int,
                   switch_interval: float | None, conn) -> None:
    """In a fresh process: load the engine, then per concurrency a warm-up and a timed run; sends the timed
    figures by concurrency, or {"error": traceback}."""
    try:
        from colibri_stream.async_engine import AsyncEngine, run

        if switch_interval is not None:
            sys.setswitchinterval(switch_interval)

        async def main() -> dict:
            engine = AsyncEngine.from_pretrained(path, **options)
            await engine.start()
            try:
                figures = {}
                for concurrency, warm_up, timed in runs:
                    await drive_engine(engine, warm_up, concurrency, output_len)
                    figures[concurrency] = await drive_engine(engine, timed, concurrency, output_len)
                    log(f"  offline, concurrency {concurrency}: {figures[concurrency]['tok_s']:.0f} tok/s")
                return figures
            finally:
                await engine.close()

        conn.send(run(main()))
    except BaseException:  # noqa: BLE001 - whatever it was, the parent reports it
        conn.send({"error": traceback.format_exc()})
    finally:
        conn.close()


def measure_offline(path: Path, options: dict, runs: list[tuple[int, list, list]], output_len: int,
                    switch_interval: float | None, timeout: float) -> dict[int, dict]:
    """`offline_worker` in a spawned process (its GPU memory is freed when it exits), killed past `timeout`."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=offline_worker, args=(str(path), options, runs, output_len, switch_interval, send),
                             daemon=True)
    worker.start()
    send.close()
    try:
        if not receive.poll(timeout):
            raise BenchmarkError(f"the offline engine run took more than {timeout:.0f} s")
        try:
            result = receive.recv()
        except EOFError:
            raise BenchmarkError(f"the offline engine process died (exit code {worker.exitcode})") from None
    finally:
        worker.join(5)
        if worker.is_alive():
            worker.kill()
            worker.join()
    if "error" in result:
        raise BenchmarkError(f"the offline engine run failed:\n{result['error']}")
    return result


# ---------------------------------------------------------------------------------------------------- served

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(path: Path, options: dict, port: int) -> list[str]:
    """`colibri serve` with the engine options of the offline run."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
    return ["colibri", "serve", "--model", str(path), "--host", "127.0.0.1", "--port", str(port), *flags]


def python_argv(command: list[str], switch_interval: float | None) -> list[str]:
    """The Python command line that runs the `colibri` `command`, with the GIL switch interval set first if given."""
    if switch_interval is None:
        return [sys.executable, "-m", "colibri_stream", *command[1:]]
    code = (f"import sys; sys.setswitchinterval({switch_interval!r}); from colibri_stream.cli import main; "
            f"sys.exit(main(sys.argv[1:]))")
    return [sys.executable, "-c", code, *command[1:]]


def wait_healthy(url: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise BenchmarkError(f"the server exited with code {server.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise BenchmarkError(f"the server was not healthy after {timeout:.0f} s")


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM (the server drains and exits), then SIGKILL past SERVER_STOP_SECONDS."""
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(SERVER_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def loop_cpu_seconds(pid: int) -> float | None:
    """CPU seconds the main thread of process `pid` has run (the server's event loop); None off Linux."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def children_cpu_seconds(pid: int) -> float | None:
    """CPU seconds the child processes of `pid` have run, every thread (the server's engine process); None off
    Linux."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        total = 0.0
        for child in children:
            fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except OSError:
        return None
    return total


def bench_once(url: str, prompts: list[list[int]], concurrency: int, output_len: int, timeout: float,
               server_pid: int) -> dict:
    """One `colibri bench` run of the prompts (token ids, /v1/completions); its report, with the client's CPU time,
    the server's event-loop CPU time and its engine process's CPU time added. Raises unless every request got
    all its tokens."""
    from colibri_stream.bench import BenchConfig, build_report, run_benchmark

    config = BenchConfig(url=url, prompts=tuple(prompts), num_requests=len(prompts), output_len=output_len,
                         endpoint="completions", concurrency=concurrency, ignore_eos=True, temperature=0.0,
                         timeout=timeout)
    cpu, loop_cpu, engine_cpu = time.process_time(), loop_cpu_seconds(server_pid), children_cpu_seconds(server_pid)
    report = build_report(asyncio.run(run_benchmark(config, progress=False)))
    report["client_cpu_s"] = time.process_time() - cpu
    loop_after, engine_after = loop_cpu_seconds(server_pid), children_cpu_seconds(server_pid)
    report["server_loop_cpu_s"] = None if loop_cpu is None or loop_after is None else loop_after - loop_cpu
    report["engine_cpu_s"] = None if engine_cpu is None or engine_after is None else engine_after - engine_cpu
    expected = len(prompts) * output_len
    if report["failed"] or report["output_tokens"] != expected:
        raise BenchmarkError(f"concurrency {concurrency}: {report['failed']} requests failed ({report['errors']}), "
                             f"{report['output_tokens']} of {expected} tokens came back")
    return report


def measure_served(path: Path, options: dict, runs: list[tuple[int, list, list]], output_len: int,
                   switch_interval: float | None, timeout: float, log_dir: Path,
                   engine_process: bool = True) -> tuple[dict[int, dict], str]:
    """Per concurrency the timed `colibri bench` report against `colibri serve` (warm-up first); the server
    command. engine_process=False serves with --no-engine-process (the steps on a thread of the server's
    process). The server is stopped whatever happens; its log is printed when something failed."""
    port = free_port()
    command = serve_command(path, options, port) + ([] if engine_process else ["--no-engine-process"])
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"serve-{port}.log"
    with open(log_path, "wb") as server_log:
        server = subprocess.Popen(python_argv(command, switch_interval), stdout=server_log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url, server, timeout)
        reports = {}
        for concurrency, warm_up, timed in runs:
            bench_once(url, warm_up, concurrency, output_len, timeout, server.pid)
            reports[concurrency] = bench_once(url, timed, concurrency, output_len, timeout, server.pid)
            log(f"  served, concurrency {concurrency}: {reports[concurrency]['output_token_throughput']:.0f} tok/s")
    except BaseException:
        log(f"the server's log ({log_path}) ends with:\n{log_tail(log_path)}")
        raise
    finally:
        stop_server(server)
    return reports, " ".join(command)


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------------- records

def percentile_ms(seconds: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(seconds) * 1e3, q)) if seconds else None


def model_records(name: str, args: argparse.Namespace, conditions: dict, log_dir: Path) -> list[dict]:
    """Offline and served figures of one model at every concurrency."""
    from colibri_stream.checkpoint import read_config
    from colibri_stream.config import CacheConfig

    path, description = model_folder(name, args.layers, Path(args.folder_root), args.device)
    config = read_config(path)
    max_batch, max_seq_len = max(args.concurrency), args.input_len + args.output_len
    # KV blocks for every sequence at its longest and one more each, whatever the model's size: no preemptions
    blocks = max_batch * (-(-max_seq_len // CacheConfig().block_size) + 1)
    options = {"device": args.device, "max_batch_size": max_batch, "max_seq_len": max_seq_len,
               "num_kv_blocks": blocks}
    runs = [(c, *prompt_sets(config.vocab_size, c, args.rounds, args.input_len)) for c in args.concurrency]
    log(f"{name}: offline")
    with step_loop_profile(args.profile, f"offline_{name}"):
        offline = measure_offline(path, options, runs, args.output_len, args.switch_interval,
                                  args.timeout * (1 + 2 * len(args.concurrency)))
    log(f"{name}: served")
    with step_loop_profile(args.profile, f"served_{name}"):
        served, server_command = measure_served(path, options, runs, args.output_len, args.switch_interval,
                                                args.timeout, log_dir, args.engine_process)
    records = []
    for concurrency, _, timed in runs:
        engine, report = offline[concurrency], served[concurrency]
        records.append({
            "bench": "serving_gpu", "model": name, "model_description": description,
            "layers": config.num_layers, "device": args.device, "engine_process": args.engine_process,
            "concurrency": concurrency, "num_requests": len(timed), "input_len": args.input_len,
            "output_len": args.output_len,
            "served_tok_s": report["output_token_throughput"], "offline_tok_s": engine["tok_s"],
            "ratio": report["output_token_throughput"] / engine["tok_s"],
            "ttft_p50_ms": report["ttft_ms"]["p50"],
            "itl_p99_ms": report["itl_ms"]["p99"] if report["itl_ms"] else None,
            "offline_ttft_p50_ms": engine["ttft_p50_ms"], "offline_itl_p99_ms": engine["itl_p99_ms"],
            "served_duration_s": report["duration_s"], "offline_duration_s": engine["duration_s"],
            # wall time per engine step: the served figure grows when the server's work delays the step thread
            "served_step_interval_ms": step_interval_ms(report["duration_s"], served_steps(report)),
            "offline_step_interval_ms": step_interval_ms(engine["duration_s"], engine["steps"]),
            # shares of the steps launched before the step before was read: a step that is not (a prompt's chunk
            # in it) leaves the device idle while the host samples, detokenizes and schedules
            "served_launched_ahead_fraction": launched_ahead_fraction(report["server"]),
            "offline_launched_ahead_fraction": engine["steps_launched_ahead"] / max(engine["steps"], 1),
            # CPU time per step: the served engine process's (all its threads), and the offline process's (its
            # step thread and its consumers); more per step served than offline for the same work is a slower core
            "served_engine_cpu_us_per_step": per_step_us(report["engine_cpu_s"], served_steps(report)),
            "offline_cpu_us_per_step": per_step_us(engine["cpu_s"], engine["steps"]),
            "served_busy_fraction": report["server"]["busy_fraction"] if report["server"] else None,
            "switch_interval_s": sys.getswitchinterval() if args.switch_interval is None else args.switch_interval,
            "client_cpu_fraction": report["client_cpu_s"] / report["duration_s"],
            "server_loop_cpu_us_per_token": None if report["server_loop_cpu_s"] is None
            else 1e6 * report["server_loop_cpu_s"] / report["output_tokens"],
            "server_command": server_command, "engine_options": options, "machine": conditions,
            "commit": conditions["commit"], "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        })
    return records


def served_steps(report: dict) -> int | None:
    """The steps the server ran during a bench run (from its /metrics), or None without them."""
    return report["server"]["steps"] if report["server"] else None


@contextlib.contextmanager
def step_loop_profile(folder: str | None, name: str):
    """With `folder`, the step loops of the processes started inside (the offline worker, the server's engine
    process) run under cProfile (COLIBRI_STEP_LOOP_PROFILE) and write FOLDER/NAME.prof, whose busiest functions
    are printed at the end; nothing without it."""
    if folder is None:
        yield
        return
    from colibri_stream.timing import PROFILE_ENV

    path = Path(folder) / f"{name}.prof"
    path.parent.mkdir(parents=True, exist_ok=True)
    os.environ[PROFILE_ENV] = str(path)
    try:
        yield
    finally:
        del os.environ[PROFILE_ENV]
    if path.exists():
        import pstats

        print(f"-- step loop of {name}: the functions of most own time")
        pstats.Stats(str(path)).sort_stats("tottime").print_stats(18)


def launched_ahead_fraction(server: dict | None) -> float | None:
    """The share of the server's steps in the run launched ahead, or None without its /metrics."""
    return server["steps_launched_ahead"] / server["steps"] if server else None


def per_step_us(seconds: float | None, steps: int | None) -> float | None:
    return 1e6 * seconds / steps if seconds is not None and steps else None


def step_interval_ms(duration: float, steps: int | None) -> float | None:
    return 1e3 * duration / steps if steps else None


def gpu_name() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else None


def markdown(records: list[dict]) -> str:
    lines = ["| model | streams | offline tok/s | served tok/s | served / offline | TTFT p50 ms | ITL p99 ms | "
             "server event loop, CPU us / token | steps launched ahead, served / offline |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        itl = "-" if r["itl_p99_ms"] is None else f"{r['itl_p99_ms']:.1f}"
        loop = r["server_loop_cpu_us_per_token"]
        lines.append(f"| {r['model']} | {r['concurrency']} | {r['offline_tok_s']:.0f} | {r['served_tok_s']:.0f} | "
                     f"{r['ratio']:.0%} | {r['ttft_p50_ms']:.1f} | {itl} | {'-' if loop is None else f'{loop:.1f}'} | "
                     f"{share(r['served_launched_ahead_fraction'])} / {share(r['offline_launched_ahead_fraction'])} |")
    return "\n".join(lines)


def share(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.0%}"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--models", nargs="+", default=[DEFAULT_MODEL, "qwen3-30b-a3b"],
                        help=f"{DEFAULT_MODEL} (the shipped model), shapes of colibri_stream.synthetic.SHAPES, or "
                             "model folders")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--rounds", type=int, default=8, help="timed requests per stream (concurrency x rounds)")
    parser.add_argument("--layers", type=int, default=8, help="layers of a synthetic model")
    parser.add_argument("--folder-root", default=os.path.join(tempfile.gettempdir(), "colibri-serving-gpu"),
                        help="where synthetic model folders are written (and found again)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds for the server to start, and for each request")
    parser.add_argument("--switch-interval", type=float, default=None, metavar="SECONDS",
                        help="sys.setswitchinterval in the server's and the offline engine's processes (default: "
                             "Python's, 0.005): how long a thread waits for the GIL before it asks for it")
    parser.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                        help="serve with the engine's steps on a thread of the server's process (colibri serve "
                             "--no-engine-process) instead of its default, a process of their own")
    parser.add_argument("--profile", metavar="FOLDER", default=None,
                        help="run the offline and served step loops under cProfile, write FOLDER/{offline,served}_"
                             "MODEL.prof and print each one's busiest functions")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.rounds < 1 or args.output_len < 2 or args.input_len < 1:
        parser.error("concurrency, rounds and input-len must be positive, output-len at least 2")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks stop the server

    conditions = dict(machine(), gpu=gpu_name() if args.device == "cuda" else None)
    records = []
    with tempfile.TemporaryDirectory(prefix="serving-gpu-") as log_dir:
        for name in args.models:
            records += model_records(name, args, conditions, Path(log_dir))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=2) + "\n")
    print(markdown(records))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchmarkError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
