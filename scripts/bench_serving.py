#!/usr/bin/env python
"""Serving benchmark for an OpenAI-compatible server, after vLLM's benchmark_serving.py.

Open loop: requests arrive as a Poisson process at --request-rate per second (inf: all at
once), whether or not earlier ones have finished. Prompts are random token ids sent as
``prompt`` token-id lists on /v1/completions; prompt and output lengths are drawn uniformly
from [len * (1 - r), len * (1 + r)] (vLLM's random dataset, r = --range-ratio), and
``ignore_eos`` with ``max_tokens`` = the output length makes every request generate exactly
that many tokens. Each request streams through the official ``openai`` client.

Per request: TTFT (until the first chunk carrying a token), ITL (the gap before each later
chunk carrying tokens: a chunk of several tokens, e.g. a speculative step's, counts its gap
once), E2E latency (until the last such chunk), output tokens (from usage, else the chunk's
token ids, else the chunks). TPOT = (E2E - TTFT) / (output tokens - 1), per request. These
are vLLM's definitions and names, so figures compare with ``vllm bench serve``'s.

    # a running server
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --rates 1,4,16
    # start `python -m jspec.serve ARGS` for each --launch (ARGS shell-quoted), plain then
    # with a drafter; docs/benchmarks.md has the 8B command
    SPEC='{"method": "eagle3", "model": "DRAFTER", "num_speculative_tokens": 3}'
    python scripts/bench_serving.py --rates 1,4 --launch "--model M" \\
        --launch "--model M --speculative-config '$SPEC'"

``--bound MODEL`` prints beside each block the workload's hardware bound (docs/benchmarks.md's
serving figures sit beside it): the model folder's shape (default: the first --launch's
model), bandwidth and bf16 matrix-peak probes run on this machine's device in a child process
before any server starts, and ``bench_throughput.workload_bound``'s prefill FLOPs + decode bytes
at the server's --max-num-seqs rows a step (the first --launch's, read by the server's own
parser; its default for a running server); a rated run can end no sooner than its last arrival. Fixed lengths only (--range-ratio 0).

Exit status 1 if any request failed (the first error is printed), 2 if a server did not start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FALLBACK_VOCAB = 256  # token ids every tokenizer has, when the model's vocabulary is unknown


# ------------------------------------------------------------------------------ workload
@dataclasses.dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


def sample_lengths(n: int, length: int, range_ratio: float, rng: np.random.Generator) -> np.ndarray:
    """n integers uniform in [floor(length * (1 - r)), ceil(length * (1 + r))], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, math.floor(length * (1 - range_ratio)))
    hi = max(lo, math.ceil(length * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def make_requests(n: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                  seed) -> list[Request]:
    """n requests of random prompt token ids in [0, vocab_size); ``seed``: numpy's (an int or
    a tuple of ints)."""
    rng = np.random.default_rng(seed)
    ins = sample_lengths(n, input_len, range_ratio, rng)
    outs = sample_lengths(n, output_len, range_ratio, rng)
    return [Request(rng.integers(0, vocab_size, size=int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


def arrival_times(n: int, rate: float, seed) -> np.ndarray:
    """Send times (s after the start) of n requests of a Poisson process at ``rate`` per
    second: exponential gaps of mean 1 / rate, the first request at 0; rate inf: all at 0."""
    if rate == math.inf:
        return np.zeros(n)
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]


# ------------------------------------------------------------------------------ one request
@dataclasses.dataclass
class Result:
    prompt_len: int
    output_len: int  # requested
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0  # s
    e2el: float = 0.0  # s, until the last chunk carrying tokens
    itl: list[float] = dataclasses.field(default_factory=list)  # s, one per chunk after the first
    chunks: int = 0  # chunks carrying tokens


async def send_request(client, model: str, req: Request, temperature: float) -> Result:
    res = Result(prompt_len=len(req.prompt), output_len=req.output_len)
    ids_seen = 0
    usage = None
    t0 = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=req.prompt, max_tokens=req.output_len, temperature=temperature,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                ids = getattr(c, "token_ids", None) or (c.model_extra or {}).get("token_ids") or []
                if not (c.text or ids):
                    continue
                if res.chunks == 0:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
                res.chunks += 1
                ids_seen += len(ids)
    except Exception as e:  # counted, not raised: the report says how many and the first
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2el = last - t0
    res.output_tokens = usage.completion_tokens if usage is not None else (ids_seen or res.chunks)
    res.success = res.chunks > 0
    if not res.success:
        res.error = "the stream carried no token"
    return res


# ------------------------------------------------------------------------------ one rate
async def run_rate(base_url: str, model: str, requests: list[Request], arrivals: np.ndarray,
                   temperature: float = 0.0, timeout: float = 3600.0, api_key: str = "none"):
    """Sends ``requests[i]`` at ``arrivals[i]`` s; returns ([Result], duration s)."""
    import httpx
    import openai

    n = len(requests)
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8),
                             timeout=httpx.Timeout(timeout))
    client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0,
                                http_client=http)
    tasks = []
    t0 = time.perf_counter()
    for req, at in zip(requests, arrivals):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send_request(client, model, req, temperature)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    await http.aclose()
    return list(results), duration


def calculate_metrics(results: list[Result], duration: float) -> dict:
    """vLLM's benchmark metrics (its JSON names; times in ms)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    m = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
         "total_token_throughput": (total_in + total_out) / duration,
         "output_len_mismatches": sum(r.output_tokens != r.output_len for r in ok),
         "mean_tokens_per_chunk": total_out / max(1, sum(r.chunks for r in ok))}
    series = {"ttft": [r.ttft for r in ok],
              "tpot": [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl],
              "e2el": [r.e2el for r in ok]}
    for name, xs in series.items():
        a = np.asarray(xs or [0.0]) * 1e3
        m[f"mean_{name}_ms"] = float(a.mean())
        m[f"median_{name}_ms"] = float(np.median(a))
        for p in (90, 99):
            m[f"p{p}_{name}_ms"] = float(np.percentile(a, p))
    return m


def format_metrics(m: dict, title: str) -> str:
    rows = [("Successful requests:", m["completed"]), ("Failed requests:", m["failed"]),
            ("Benchmark duration (s):", f"{m['duration']:.2f}"),
            ("Total input tokens:", m["total_input_tokens"]), ("Total generated tokens:", m["total_output_tokens"]),
            ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s):", f"{m['total_token_throughput']:.2f}"),
            ("Mean tokens per chunk:", f"{m['mean_tokens_per_chunk']:.2f}")]
    if m.get("spec_decode"):
        s = m["spec_decode"]
        rows += [("Drafts:", int(s["num_drafts"])), ("Mean acceptance length:", f"{s['mean_acceptance_length']:.2f}")]
    if m.get("compilations") is not None:
        rows += [("Step shapes compiled during the run:", m["compilations"])]
    lines = ["=" * 60, title, "=" * 60] + [f"{k:<44}{v:>16}" for k, v in rows]
    for name, head in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{head:-^60}")
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            lines.append(f"{f'{label} {name.upper()} (ms):':<44}{m[f'{stat}_{name}_ms']:>16.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the server
def _get(base_url: str, path: str, api_key: str | None = None, timeout: float = 10.0):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + path, headers=headers, timeout=timeout)
    r.raise_for_status()
    return r


def model_card(base_url: str, model: str | None, api_key: str | None) -> dict:
    """The /v1/models entry of ``model`` (default: the first listed)."""
    cards = _get(base_url, "/v1/models", api_key).json()["data"]
    for c in cards:
        if model is None or c["id"] == model:
            return c
    raise SystemExit(f"model {model!r} not served at {base_url}; it serves {[c['id'] for c in cards]}")


def vocab_size_of(card: dict) -> int:
    """The vocabulary of the model folder the server reports (``root``), when it is readable
    here; else FALLBACK_VOCAB."""
    with contextlib.suppress(OSError, TypeError, KeyError, ValueError):
        with open(os.path.join(card["root"], "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    return FALLBACK_VOCAB


SPEC_COUNTERS = {"vllm:spec_decode_num_drafts_total": "num_drafts",
                 "vllm:spec_decode_num_draft_tokens_total": "num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens_total": "num_accepted_tokens"}
COUNTERS = {**SPEC_COUNTERS, "jspec:num_compilations": "num_compilations"}  # jspec's compiled step shapes


def server_counters(base_url: str) -> dict:
    """The counters of ``COUNTERS`` from one read of /metrics, summed over labels; those a
    server does not export (or all, if /metrics fails) are absent."""
    out = {}
    try:
        text = _get(base_url, "/metrics").text
    except Exception:
        return out
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in COUNTERS:
            out[COUNTERS[name]] = out.get(COUNTERS[name], 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def compilations_delta(before: dict, after: dict) -> int | None:
    if "num_compilations" not in before or "num_compilations" not in after:
        return None
    return int(after["num_compilations"] - before["num_compilations"])


def spec_decode_delta(before: dict, after: dict) -> dict | None:
    spec = SPEC_COUNTERS.values()
    if not any(k in before for k in spec) or not any(k in after for k in spec):
        return None
    d = {k: after[k] - before.get(k, 0.0) for k in spec if k in after}
    if not d.get("num_drafts"):
        return None
    d["mean_acceptance_length"] = 1.0 + d["num_accepted_tokens"] / d["num_drafts"]  # vLLM's: the bonus token included
    return d


class LaunchedServer:
    """``python -m jspec.serve ARGS`` on a free loopback port (unless ARGS name --port)."""

    def __init__(self, args: str, timeout: float):
        argv = shlex.split(args)
        known, _ = _port_parser().parse_known_args(argv)
        self.port = known.port or _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "jspec.serve", *argv] + ([] if known.port else ["--port", str(self.port)])
        fd, self.log_path = tempfile.mkstemp(prefix="bench-serving-", suffix=".log")
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        print(f"launching: {shlex.join(cmd)}  (log: {self.log_path})", flush=True)
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=fd, stderr=subprocess.STDOUT, env=env)
        os.close(fd)
        self._wait_healthy(timeout)

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def _wait_healthy(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # graceful: drains, then exits 0
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def _port_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--port", type=int, default=None)
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ driver
def bench_server(base_url: str, a, label: str, bound=None) -> list[dict]:
    """Every rate of ``a.rates`` against one server; one result block per rate. ``bound``:
    (target ModelConfig, max_num_seqs, bandwidth, matrix peak) for each block's bound."""
    card = model_card(base_url, a.model, a.api_key)
    model = card["id"]
    vocab = a.vocab_size or vocab_size_of(card)
    max_len = card.get("max_model_len")
    need = math.ceil(a.input_len * (1 + a.range_ratio)) + math.ceil(a.output_len * (1 + a.range_ratio))
    if max_len is not None and need > max_len:
        raise SystemExit(f"prompts + outputs reach {need} tokens; the server's max_model_len is {max_len}")
    print(f"model {model} at {base_url}: prompt token ids in [0, {vocab})", flush=True)
    # An untimed first request (vLLM's initial test run): the server works, its first-use costs are paid.
    warm = make_requests(1, a.input_len, a.output_len, 0.0, vocab, (a.seed, 1 << 20))
    res, _ = asyncio.run(run_rate(base_url, model, warm, np.zeros(1), a.temperature, a.timeout, a.api_key or "none"))
    if not res[0].success:
        print(f"initial test request failed: {res[0].error}", file=sys.stderr)
    blocks = []
    for i, rate in enumerate(a.rates):
        # fresh prompts per rate (seed, rate index): a repeated prompt would hit the prefix cache
        reqs = make_requests(a.num_prompts, a.input_len, a.output_len, a.range_ratio, vocab, (a.seed, i, 0))
        arrivals = arrival_times(a.num_prompts, rate, (a.seed, i, 1))
        before = server_counters(base_url)
        results, duration = asyncio.run(run_rate(base_url, model, reqs, arrivals, a.temperature, a.timeout,
                                                 a.api_key or "none"))
        m = calculate_metrics(results, duration)
        after = server_counters(base_url)
        m["spec_decode"] = spec_decode_delta(before, after)
        m["compilations"] = compilations_delta(before, after)
        title = f"{label} | rate {rate:g} req/s"
        print(format_metrics(m, title), flush=True)
        if bound is not None:  # (cfg, max_num_seqs, bandwidth, peak)
            m["bound"] = b = serving_bound(bound[0], a.num_prompts, a.input_len, a.output_len, bound[1], bound[2],
                                           bound[3], float(arrivals[-1]))
            print(f"bound: {b['seconds']:.2f} s (hardware {b['hardware_s']:.2f} s: prefill {b['prefill_s']:.2f} + "
                  f"decode {b['decode_s']:.2f}; last arrival {b['last_arrival_s']:.2f} s), {b['output_tok_s']:.0f} "
                  f"output tok/s: achieved {b['seconds'] / duration:.2f} of it", flush=True)
        errors = [r.error for r in results if not r.success]
        if errors:
            print(f"{len(errors)} failed; first error: {errors[0]}", file=sys.stderr, flush=True)
        if m["output_len_mismatches"]:
            print(f"warning: {m['output_len_mismatches']} requests did not produce their output length "
                  "(does the server honour ignore_eos?)", file=sys.stderr, flush=True)
        blocks.append({"server": label, "base_url": base_url, "model": model, "request_rate": _rate_json(rate), **m,
                       "first_error": errors[0] if errors else None,
                       "requests": [{"prompt_len": r.prompt_len, "output_len": r.output_len,
                                     "output_tokens": r.output_tokens, "success": r.success, "ttft": r.ttft,
                                     "e2el": r.e2el, "chunks": r.chunks, "error": r.error or None}
                                    for r in results]})
    return blocks


# ------------------------------------------------------------------------------ the bound
PROBE = """
import json, os, sys
sys.path.insert(0, {scripts!r})
from bench_common import measure_bandwidth
from bench_throughput import measure_matrix_peak
quick = os.environ.get("JAX_PLATFORMS") == "cpu"
print(json.dumps(dict(bw=measure_bandwidth(quick)["best_TBps"] * 1e12, peak=measure_matrix_peak(quick))))
"""


def probe_device() -> tuple[float, float]:
    """(bandwidth bytes/s, bf16 matrix FLOP/s) of this machine's device, measured in a child
    process (its memory is the device's again before a server starts)."""
    code = PROBE.format(scripts=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    d = json.loads(out.strip().splitlines()[-1])
    return d["bw"], d["peak"]


def launch_settings(args: str) -> tuple[str | None, int]:
    """(model folder or None, max_num_seqs) of a --launch argument string, as the server's own
    parser reads them (its defaults included)."""
    from jspec.serve.cli import build_parser

    known, _ = build_parser().parse_known_args(shlex.split(args))
    return known.model or known.model_tag, known.max_num_seqs


def serving_bound(cfg, n: int, input_len: int, output_len: int, max_seqs: int, bw: float, peak: float,
                  last_arrival: float) -> dict:
    """The least time the workload can take: the hardware's (bench_throughput.workload_bound),
    and no sooner than its last request arrives; with the output tok/s it allows."""
    from bench_throughput import workload_bound

    hw = workload_bound(cfg, n, input_len, output_len, max_seqs, peak, bw)
    seconds = max(hw.seconds, last_arrival)
    return dict(seconds=seconds, hardware_s=hw.seconds, prefill_s=hw.prefill_s, decode_s=hw.decode_s,
                last_arrival_s=last_arrival, output_tok_s=n * output_len / seconds)


def _rate_json(rate: float):
    return "inf" if rate == math.inf else rate  # JSON has no infinity


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--base-url", default=None, help="a running server (default http://127.0.0.1:8000)")
    where.add_argument("--launch", action="append", metavar="ARGS",
                       help="start `python -m jspec.serve ARGS` (shell-quoted), benchmark it, stop it; repeatable")
    p.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (inf: all at once)")
    p.add_argument("--rates", default=None, help="comma-separated request rates, one result block each "
                                                 "(overrides --request-rate)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests per rate")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids in [0, V) (default: the served folder's config.json, else 256)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--launch-timeout", type=float, default=1800.0, help="seconds a launched server may take to start")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    p.add_argument("--bound", nargs="?", const="", default=None, metavar="MODEL",
                   help="print the workload's hardware bound beside each block (MODEL: the target's folder, "
                        "default the first --launch's --model)")
    a = p.parse_args(argv)
    a.rates = [float(r) for r in a.rates.split(",")] if a.rates else [a.request_rate]
    return a


def bound_inputs(a):
    """(ModelConfig, max_num_seqs, bandwidth, peak) for --bound, or None without it."""
    if a.bound is None:
        return None
    if a.range_ratio:
        raise SystemExit("--bound takes fixed lengths: --range-ratio 0")
    model, seqs = launch_settings(a.launch[0] if a.launch else "")  # a running server: its defaults assumed
    folder = a.bound or model
    if not folder:
        raise SystemExit("--bound needs the target's folder (or a --launch with --model)")
    from jspec.config import load_model_config

    bw, peak = probe_device()
    print(f"bound inputs: {folder}, {seqs} rows a step, bandwidth {bw / 1e12:.2f} TB/s, bf16 matrix peak "
          f"{peak / 1e12:.0f} TFLOP/s", flush=True)
    return load_model_config(folder), seqs, bw, peak


def main(argv=None) -> int:
    a = parse_args(argv)
    blocks, launch_failed = [], False
    bound = bound_inputs(a)
    if a.launch:
        for args in a.launch:
            try:
                srv = LaunchedServer(args, a.launch_timeout)
            except RuntimeError as e:
                print(f"server `{args}` did not start: {e}", file=sys.stderr)
                launch_failed = True
                continue
            try:
                blocks += bench_server(srv.base_url, a, f"jspec.serve {args}", bound)
            finally:
                rc = srv.stop()
                print(f"server stopped (exit {rc}); log: {srv.log_path}", flush=True)
    else:
        url = a.base_url or "http://127.0.0.1:8000"
        blocks += bench_server(url, a, url, bound)
    if a.json:
        with open(a.json, "w") as f:
            args = {k: v for k, v in vars(a).items() if k != "api_key"}
            args.update(request_rate=_rate_json(a.request_rate), rates=[_rate_json(r) for r in a.rates])
            json.dump({"args": args, "results": blocks}, f, indent=1)
    if launch_failed:
        return 2
    return 1 if any(b["failed"] for b in blocks) else 0


if __name__ == "__main__":
    sys.exit(main())
