"""The OpenAI-compatible server, end to end: a real ``python -m jspec.serve`` subprocess on
the embedded tiny default model, driven with the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time

import httpx
import openai
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))  # load_test

import load_test  # noqa: E402

from tests.helpers.serve import ENGINE_KWARGS, TINY_MODEL, metric, metric_samples, start_server  # noqa: E402

PROMPTS = ["Hello there", "The quick brown fox", "Request 7: alpha bravo"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def _server_proc():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_LOG_STATS_INTERVAL", "1")  # the periodic stats lines within the module's run
        srv = start_server(wait=False)  # starts up while the reference engine (ref) loads
    try:
        yield srv
    finally:
        rc = srv.stop(signal.SIGINT)
        assert rc == 0, f"server exited with {rc} on SIGINT\n{srv.log()[-3000:]}"


@pytest.fixture(scope="module")
def server(_server_proc, ref):
    _server_proc.wait_healthy()
    return _server_proc


@pytest.fixture(scope="module")
def ref(_server_proc):
    """jspec.LLM with the server's engine arguments: the ground truth for greedy outputs."""
    import jspec

    llm = jspec.LLM(**ENGINE_KWARGS)
    cache = {}

    def greedy(prompts, max_tokens, chat=False):
        """[(text, token_ids)] for completions prompts or chat message lists."""
        keys = [(json.dumps(p), max_tokens, chat) for p in prompts]
        todo = [(k, p) for k, p in zip(keys, prompts) if k not in cache]
        if todo:
            tok = llm.engine.tokenizer
            inputs = [list(_ids(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)))
                      if chat else p for _, p in todo]
            outs = llm.generate(inputs, jspec.SamplingParams(temperature=0.0, max_tokens=max_tokens))
            for (k, _), o in zip(todo, outs):
                cache[k] = (o.text, list(o.token_ids))
        return [cache[k] for k in keys]

    greedy.llm = llm
    yield greedy


def _ids(x):
    return x["input_ids"] if hasattr(x, "keys") else x


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _model(client):
    return client.models.list().data[0].id


def _engine_state(server):
    return httpx.get(server.base_url + "/v1/debug/engine", timeout=10).json()


def _wait_pages_free(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        st = _engine_state(server)
        if st["num_free_pages"] == st["num_pages"] and st["num_active_requests"] == 0:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"pages still held after {timeout}s: {st}")
        time.sleep(0.05)


# ----------------------------------------------------------------------------- basics
def test_models_and_health(server, client):
    assert httpx.get(server.base_url + "/health").status_code == 200
    models = client.models.list().data
    # vLLM's served name: --model exactly as given (a request names it so), the folder's name is not it
    assert [m.id for m in models] == [TINY_MODEL]
    assert models[0].model_extra["max_model_len"] == 128
    r = client.completions.create(model=TINY_MODEL, prompt="Hi", max_tokens=2)
    assert r.model == TINY_MODEL
    with pytest.raises(openai.NotFoundError, match=f"This server serves `{TINY_MODEL}`"):
        client.completions.create(model=os.path.basename(TINY_MODEL), prompt="Hi", max_tokens=2)


def test_completions_match_generate(server, client, ref):
    model = _model(client)
    want = ref(PROMPTS, 12)
    for prompt, (text, ids) in zip(PROMPTS, want):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.0,
                                      extra_body={"return_token_ids": True})
        c = r.choices[0]
        assert c.text == text and c.model_extra["token_ids"] == ids
        assert c.finish_reason == ("length" if len(ids) == 12 else "stop")
        n_prompt = len(ref.llm.engine.tokenize(prompt))
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(ids))
        assert r.usage.total_tokens == n_prompt + len(ids)
        # streaming: the pieces add up to the same text; usage comes last
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    # a prompt of token ids
    ids_prompt = ref.llm.engine.tokenize(PROMPTS[0])
    r = client.completions.create(model=model, prompt=ids_prompt, max_tokens=12, temperature=0.0)
    assert r.choices[0].text == want[0][0]


def test_chat_matches_generate(server, client, ref):
    model = _model(client)
    (text, ids), = ref([CHAT], 10, chat=True)
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0.0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.usage.completion_tokens == len(ids)
    r2 = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=10, temperature=0.0)
    assert r2.choices[0].message.content == text
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0.0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_raw_sse_ends_with_done(server):
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                      json={"prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_stop_strings_and_sampling(server, client, ref):
    model = _model(client)
    (text, _), = ref([PROMPTS[1]], 16)
    if len(text) >= 4:
        stop = text[2:4]
        r = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=16, temperature=0.0, stop=[stop])
        assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"
        s = list(client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=16, temperature=0.0,
                                           stop=stop, stream=True))
        assert "".join(c.choices[0].text for c in s) == text[: text.find(stop)]
    # seeded sampling is reproducible
    kw = dict(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, top_p=0.9, seed=1234,
              extra_body={"top_k": 50, "return_token_ids": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]


# ------------------------------------------------------------------------------ errors
def _bad_requests(model):
    long_prompt = "x" * 200  # 200 byte tokens > max_model_len 128
    ok = {"model": model, "prompt": "Hi", "max_tokens": 2}
    C, CH = "/v1/completions", "/v1/chat/completions"
    return [
        # (name, path, body (bytes or dict), status, param, message fragment)
        ("malformed json", C, b'{"prompt": "Hi", ', 400, None, "Malformed JSON"),
        ("not an object", C, b'[1, 2]', 400, None, "JSON object"),
        ("max_tokens str", C, {**ok, "max_tokens": "5"}, 400, "max_tokens", "max_tokens"),
        ("temperature str", C, {**ok, "temperature": "hot"}, 400, "temperature", "temperature"),
        ("stream int", C, {**ok, "stream": 1}, 400, "stream", "stream"),
        ("prompt dict", C, {**ok, "prompt": {"a": 1}}, 400, "prompt", "prompt"),
        ("missing prompt", C, {"model": model, "max_tokens": 2}, 400, "prompt", "Missing required field 'prompt'"),
        ("messages str", CH, {"model": model, "messages": "hi"}, 400, "messages", "messages"),
        ("empty messages", CH, {"model": model, "messages": []}, 400, "messages", "messages"),
        ("prompt too long", C, {**ok, "prompt": long_prompt}, 400, "prompt", "maximum context length is 128"),
        ("context overflow", C, {**ok, "max_tokens": 1000}, 400, "max_tokens", "maximum context length is 128"),
        ("max_tokens 0", C, {**ok, "max_tokens": 0}, 400, "max_tokens", "at least 1"),
        ("max_tokens -3", C, {**ok, "max_tokens": -3}, 400, "max_tokens", "at least 1"),
        ("chat max_completion_tokens 0", CH, {"model": model, "messages": CHAT, "max_completion_tokens": 0},
         400, "max_completion_tokens", "at least 1"),
        ("temperature < 0", C, {**ok, "temperature": -1}, 400, "temperature", "temperature"),
        ("top_p 0", C, {**ok, "top_p": 0}, 400, "top_p", "top_p"),
        ("token out of vocab", C, {**ok, "prompt": [1, 99999]}, 400, "prompt", "99999"),
        ("empty prompt", C, {**ok, "prompt": ""}, 400, "prompt", "empty"),
        ("n=0", C, {**ok, "n": 0}, 400, "n", "n must be an integer >= 1"),
        ("logprobs above max", C, {**ok, "logprobs": 21}, 400, "logprobs", "max_logprobs=20"),
        ("chat top_logprobs above max", CH, {"model": model, "messages": CHAT, "logprobs": True, "top_logprobs": 21},
         400, "top_logprobs", "max_logprobs=20"),
        ("penalty out of range", C, {**ok, "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
        ("logit_bias out of vocab", C, {**ok, "logit_bias": {"99999": 1}}, 400, "logit_bias", "vocabulary"),
        ("unknown model", C, {**ok, "model": "gpt-17"}, 404, "model", "gpt-17"),
        ("unknown route", "/v1/embeddings", ok, 404, None, "Not Found"),
    ]


def test_bad_inputs_while_a_stream_runs(server, client, ref):
    model = _model(client)
    (want, _), = ref([PROMPTS[2]], 100)
    got, errors = [], []

    def good_stream():
        try:
            s = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=100, temperature=0.0, stream=True)
            for ch in s:
                got.append(ch.choices[0].text)
                time.sleep(0.01)  # a slow reader: stays in flight while the bad requests arrive
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=good_stream)
    t.start()
    with httpx.Client(base_url=server.base_url, timeout=60) as h:
        for name, path, body, status, param, frag in _bad_requests(model):
            kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
            r = h.post(path, **kw)
            assert r.status_code == status, (name, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, (name, err)
            assert frag.lower() in err["message"].lower(), (name, err)
            if param is not None:
                assert err["param"] == param, (name, err)
        # unknown fields are ignored (as vLLM does), not an error
        r = h.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2, "frobnicate": 1})
        assert r.status_code == 200, r.text
    # the official client surfaces them as the matching exception types
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "y" * 300}])
    t.join(120)
    assert not errors and "".join(got) == want
    _wait_pages_free(server)


# --------------------------------------------------------------------- disconnects
def test_disconnected_clients_free_their_pages(server):
    start = _wait_pages_free(server)
    m0 = metric_samples(httpx.get(server.base_url + "/metrics").text)
    assert metric(m0, "jspec:kv_cache_free_pages") == start["num_free_pages"]

    async def one(i, http):
        prompt = f"Disconnect {i}: " + "abc " * 5
        # every other client sends a prompt array: both of its engine requests end with it
        body = {"prompt": [prompt, prompt + "z"] if i % 2 else prompt, "max_tokens": 90, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return  # leave mid-stream: closes the connection

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60,
                                     limits=httpx.Limits(max_keepalive_connections=0)) as http:
            await asyncio.gather(*(one(i, http) for i in range(20)))

    asyncio.run(run())
    t0 = time.monotonic()  # all 20 connections closed
    end = _wait_pages_free(server)
    freed_after = time.monotonic() - t0
    assert end["num_free_pages"] == start["num_free_pages"]
    m1 = metric_samples(httpx.get(server.base_url + "/metrics").text)
    assert metric(m1, "jspec:kv_cache_free_pages") == start["num_free_pages"]
    # they were aborted, not run to completion: 30 aborts, far fewer than 30 * 90 tokens
    aborted = metric(m1, "vllm:request_success_total", finished_reason="abort") - \
        metric(m0, "vllm:request_success_total", finished_reason="abort")
    generated = metric(m1, "vllm:generation_tokens_total") - metric(m0, "vllm:generation_tokens_total")
    print(f"\n20 disconnects: all pages free {freed_after * 1e3:.0f} ms after the last close; "
          f"{generated:.0f} tokens generated in all")
    assert aborted == 30
    assert generated < 30 * 90 / 2


def test_disconnected_non_streaming_requests_are_aborted_quietly(server, client):
    """Non-streaming requests whose clients leave mid-generation (n > 1, a prompt array, one
    prompt) are aborted with one log line each: no traceback, no unretrieved gather."""
    start = _wait_pages_free(server)
    m0 = metric_samples(httpx.get(server.base_url + "/metrics").text)
    log0 = len(server.log())
    bodies = [{"prompt": "Leave 1", "n": 3, "temperature": 1.0}, {"prompt": ["Leave 2", "Leave 3"]}, {"prompt": "Leave 4"}]

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            posts = [asyncio.ensure_future(http.post("/v1/completions", json={
                "max_tokens": 110, "temperature": 0, "ignore_eos": True, **b})) for b in bodies]
            while (await http.get("/v1/debug/engine")).json()["num_active_requests"] < 4:  # all generating
                assert not any(p.done() for p in posts), [p.result().text for p in posts if p.done()]
                await asyncio.sleep(0.02)
            for p in posts:
                p.cancel()  # the client goes away: its connection closes
            await asyncio.gather(*posts, return_exceptions=True)

    asyncio.run(run())
    end = _wait_pages_free(server)
    assert end["num_free_pages"] == start["num_free_pages"]
    m1 = metric_samples(httpx.get(server.base_url + "/metrics").text)
    aborted = metric(m1, "vllm:request_success_total", finished_reason="abort") - \
        metric(m0, "vllm:request_success_total", finished_reason="abort")
    generated = metric(m1, "vllm:generation_tokens_total") - metric(m0, "vllm:generation_tokens_total")
    assert aborted == 4 and generated < 6 * 110 / 2  # 4 engine requests, 6 samples, stopped early
    log = server.log()[log0:]
    assert "Traceback" not in log and "never retrieved" not in log and "CancelledError" not in log, log
    assert log.count("the client disconnected; aborted") == 3, log
    r = client.completions.create(model=TINY_MODEL, prompt="Leave 1", max_tokens=4, n=2, seed=0)  # later ones work
    assert len(r.choices) == 2 and r.usage.completion_tokens > 0


# ------------------------------------------------------------------------- metrics
def test_metrics_parse_and_move(server, client):
    text0 = httpx.get(server.base_url + "/metrics").text
    fams = {f.name: f for f in __import__("prometheus_client.parser", fromlist=["x"]).text_string_to_metric_families(text0)}
    for name in ["vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
                 "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "jspec:kv_cache_free_pages", "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos"]:
        assert name in fams, name
    assert fams["vllm:time_to_first_token_seconds"].type == "histogram"
    assert fams["vllm:spec_decode_num_drafts"].type == "counter"
    m0 = metric_samples(text0)
    model = _model(client)
    usage = [client.completions.create(model=model, prompt=p, max_tokens=5, temperature=0.0).usage for p in PROMPTS[:2]]
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0.0, stream=True,
                                       stream_options={"include_usage": True})
    usage.append([c for c in r][-1].usage)
    m1 = metric_samples(httpx.get(server.base_url + "/metrics").text)

    def d(name, **labels):
        return metric(m1, name, **labels) - metric(m0, name, **labels)

    assert d("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert d("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usage)
    finished = d("vllm:request_success_total", finished_reason="length") + d("vllm:request_success_total", finished_reason="stop")
    assert finished == 3
    assert d("vllm:time_to_first_token_seconds_count") == 3
    assert d("vllm:e2e_request_latency_seconds_count") == 3
    assert d("vllm:request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usage)
    # vLLM counts the prefix cache in tokens: every prompt token is looked up once here
    assert d("vllm:prefix_cache_queries_total") == sum(u.prompt_tokens for u in usage)
    assert d("vllm:prefix_cache_hits_total") % ENGINE_KWARGS["page_size"] == 0
    assert d("jspec:http_requests_total", handler="/v1/completions", method="POST", status="200") == 2
    assert metric(m1, "vllm:num_requests_running") == 0 and metric(m1, "vllm:num_requests_waiting") == 0


# ---------------------------------------------------------------------------- load
def test_load_64_streaming_clients(server, ref):
    prompts = load_test.default_prompts(16)
    max_tokens = 16
    chat_every = 4
    expected = {}
    for p, (text, _) in zip(prompts, ref(prompts, max_tokens)):
        expected[(False, p)] = text
    for p, (text, _) in zip(prompts, ref([[{"role": "user", "content": p}] for p in prompts], max_tokens, chat=True)):
        expected[(True, p)] = text
    kw = dict(clients=64, max_tokens=max_tokens, prompts=prompts, expected=expected,
              chat_every=chat_every, timeout=240)
    # round 1 (cold: the server compiles the batch shapes it has not seen yet; on CPU that
    # dominates its latencies), round 2 (warm: the numbers to record)
    cold = asyncio.run(load_test.run_load(server.base_url, requests=1, **kw))
    print("\ncold " + load_test.format_summary(cold))
    s = asyncio.run(load_test.run_load(server.base_url, requests=3, **kw))
    print("warm " + load_test.format_summary(s))
    assert cold["num_errors"] == 0 and cold["num_mismatches"] == 0, (cold["errors"], cold["mismatches"])
    assert s["num_errors"] == 0, s["errors"]
    assert s["num_requests"] == 64 * 3
    assert s["num_mismatches"] == 0, s["mismatches"]
    assert s["no_first_token"] == 0
    assert all((r["chat"], r["prompt"]) in expected for r in s["results"])
    _wait_pages_free(server)


def test_server_log(server):
    """What the module's server logged: the model and its drafter, the periodic stats lines
    (VLLM_LOG_STATS_INTERVAL=1 here, as vLLM's; "KV cache usage" on a CPU), and no traceback."""
    log = server.log()
    assert f"serving {TINY_MODEL} on {server.base_url} (no drafter; max_model_len=128" in log
    stats = [line for line in log.splitlines() if "jspec.serve.stats" in line]
    assert stats and all("Avg prompt throughput:" in line and " reqs, KV cache usage: " in line for line in stats)
    assert "Traceback" not in log and "Unable to initialize backend 'tpu'" not in log
