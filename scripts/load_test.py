#!/usr/bin/env python
"""Load test for an OpenAI-compatible server (jspec.serve, or vLLM for comparison).

N concurrent streaming clients (the official ``openai`` client), each sending R requests
back to back. Reports p50/p99 time to first token (first chunk carrying text or token ids),
p50/p99 end-to-end latency, output tokens/s and requests/s; checks every request finished
without error and, when expected outputs are given, that the streamed text matches.

    python scripts/load_test.py --base-url http://127.0.0.1:8000 --clients 64 --requests 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time


def default_prompts(n: int) -> list[str]:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    return [f"Request {i}: " + " ".join(words[: 1 + i % len(words)]) for i in range(n)]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def _one(client, model, prompt, max_tokens, chat):
    t0 = time.perf_counter()
    ttft = None
    text, usage, finish = [], None, None
    extra = {"return_token_ids": True}
    if chat:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0.0, stream=True, stream_options={"include_usage": True}, extra_body=extra)
    else:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = (c.delta.content if chat else c.text) or ""
            ids = getattr(c, "token_ids", None) or (c.model_extra or {}).get("token_ids")
            if ttft is None and (piece or ids):
                ttft = time.perf_counter() - t0
            text.append(piece)
            finish = c.finish_reason or finish
    return {"prompt": prompt, "chat": chat, "text": "".join(text), "ttft": ttft,
            "e2e": time.perf_counter() - t0, "finish_reason": finish,
            "completion_tokens": usage.completion_tokens if usage else 0}


async def run_load(base_url: str, model: str | None = None, clients: int = 64, requests: int = 4,
                   max_tokens: int = 16, prompts: list[str] | None = None,
                   expected: dict | None = None, chat_every: int = 0, timeout: float = 300.0) -> dict:
    """Run the load; returns a summary dict (see ``format_summary``).

    ``expected`` maps (chat: bool, prompt) -> greedy text; ``chat_every=k`` makes every k-th
    request a chat completion (0: completions only).
    """
    import httpx
    import openai

    prompts = prompts or default_prompts(16)
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 8,
                                                 max_keepalive_connections=clients + 8),
                             timeout=httpx.Timeout(timeout))
    client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none",
                                max_retries=0, http_client=http)
    if model is None:
        model = (await client.models.list()).data[0].id
    results, errors = [], []

    async def worker(c: int):
        for r in range(requests):
            k = c * requests + r
            chat = bool(chat_every) and k % chat_every == chat_every - 1
            prompt = prompts[k % len(prompts)]
            try:
                results.append(await _one(client, model, prompt, max_tokens, chat))
            except Exception as e:  # reported, not raised: the summary counts them
                errors.append(f"client {c} request {r}: {type(e).__name__}: {e}")

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(worker(c) for c in range(clients))), timeout)
    wall = time.perf_counter() - t0
    await http.aclose()
    mismatches = []
    if expected is not None:
        for res in results:
            want = expected.get((res["chat"], res["prompt"]))
            if want is not None and res["text"] != want:
                mismatches.append({"prompt": res["prompt"], "chat": res["chat"], "got": res["text"], "want": want})
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    e2es = [r["e2e"] for r in results]
    toks = sum(r["completion_tokens"] for r in results)
    return {
        "clients": clients, "requests_per_client": requests, "max_tokens": max_tokens,
        "num_requests": len(results), "num_errors": len(errors), "errors": errors[:10],
        "num_mismatches": len(mismatches), "mismatches": mismatches[:5],
        "no_first_token": sum(r["ttft"] is None for r in results),
        "wall_s": wall, "completion_tokens": toks, "tokens_per_s": toks / wall if wall else 0.0,
        "requests_per_s": len(results) / wall if wall else 0.0,
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
        "e2e_p50_s": percentile(e2es, 0.5), "e2e_p99_s": percentile(e2es, 0.99),
        "finish_reasons": {k: sum(r["finish_reason"] == k for r in results)
                           for k in {r["finish_reason"] for r in results}},
        "results": results,
    }


def format_summary(s: dict) -> str:
    return (f"load: {s['clients']} clients x {s['requests_per_client']} streaming requests "
            f"(max_tokens={s['max_tokens']}): {s['num_requests']} ok, {s['num_errors']} errors, "
            f"{s['num_mismatches']} mismatches in {s['wall_s']:.2f}s | "
            f"TTFT p50 {s['ttft_p50_s'] * 1e3:.0f} ms, p99 {s['ttft_p99_s'] * 1e3:.0f} ms | "
            f"e2e p50 {s['e2e_p50_s'] * 1e3:.0f} ms, p99 {s['e2e_p99_s'] * 1e3:.0f} ms | "
            f"{s['tokens_per_s']:.1f} output tok/s, {s['requests_per_s']:.1f} req/s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--chat-every", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = p.parse_args(argv)
    s = asyncio.run(run_load(a.base_url, a.model, a.clients, a.requests, a.max_tokens,
                             chat_every=a.chat_every, timeout=a.timeout))
    s.pop("results")
    print(json.dumps(s, indent=2) if a.json else format_summary(s))
    for e in s["errors"]:
        print("  error:", e, file=sys.stderr)
    return 1 if s["num_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
