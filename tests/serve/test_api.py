"""The request surface vLLM users bring, on the app in-process (starlette's TestClient):
--api-key, /v1/models/{id}, OpenAI's max_tokens default for completions, a stop-string
finish counted as a finished request ("stop") in /metrics, its latency included, and vLLM's
/tokenize and /detokenize against the model's HF tokenizer."""

from __future__ import annotations

import time

import pytest

import jspec
from tests.helpers.serve import ENGINE_KWARGS, metric


@pytest.fixture(scope="module")
def llm():
    return jspec.LLM(**ENGINE_KWARGS)


@pytest.fixture(scope="module")
def stop_ref(llm):
    """Generated before the server starts: its engine thread steps the same engine, and two
    threads stepping one engine race (a test that generated beside it hung under load)."""
    return llm.generate(["The quick brown fox"], jspec.SamplingParams(temperature=0, max_tokens=24,
                                                                     ignore_eos=True))[0].text


@pytest.fixture(scope="module")
def client(llm, stop_ref):
    from starlette.testclient import TestClient

    from jspec.serve.app import create_app

    with TestClient(create_app(llm.engine, "tiny", api_key="s3cret")) as c:
        yield c


AUTH = {"Authorization": "Bearer s3cret"}


def test_api_key(client):
    assert client.get("/health").status_code == 200  # open, as vLLM's
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
        r = client.get("/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
        r = client.post("/v1/completions", headers=headers, json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 401
    assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny"


def test_model_by_id(client):
    r = client.get("/v1/models/tiny", headers=AUTH)
    assert r.status_code == 200 and r.json()["id"] == "tiny" and r.json()["max_model_len"] == 128
    r = client.get("/v1/models/gpt-17", headers=AUTH)
    assert r.status_code == 404 and "gpt-17" in r.json()["error"]["message"]


def test_completion_max_tokens_defaults_to_16(client):
    r = client.post("/v1/completions", headers=AUTH, json={"prompt": "Hello", "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    # a chat completion still runs to the end of the context
    r = client.post("/v1/chat/completions", headers=AUTH, json={
        "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": True})
    body = r.json()
    assert body["usage"]["total_tokens"] == 128, body["usage"]


def test_stop_string_finish_counts_as_stop(client, stop_ref):
    text = stop_ref
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip() and text[i:i + 2] not in text[:i])
    m0 = client.get("/metrics").text
    r = client.post("/v1/completions", headers=AUTH, json={
        "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == text[: text.find(stop)]
    # The response can reach the client before the engine thread records the finished
    # request in the metrics: poll briefly (bounded) for the count to move.
    deadline = time.monotonic() + 10
    while True:
        m1 = client.get("/metrics").text
        if metric(m1, "vllm:e2e_request_latency_seconds_count") > metric(m0, "vllm:e2e_request_latency_seconds_count") \
                or time.monotonic() > deadline:
            break
        time.sleep(0.05)

    def d(name, **labels):
        return metric(m1, name, **labels) - metric(m0, name, **labels)

    assert d("vllm:request_success_total", finished_reason="stop") == 1
    assert d("vllm:request_success_total", finished_reason="abort") == 0
    assert d("vllm:e2e_request_latency_seconds_count") == 1


def test_usage_reports_the_requests_speculative_counters():
    """With a drafter, a response's usage carries that request's drafts and acceptance,
    equal to what jspec.LLM reports for the same greedy request (the embedded family)."""
    from starlette.testclient import TestClient

    from jspec.serve.app import create_app

    kw = dict(speculative_config={"method": "eagle3"}, dtype="float32", max_model_len=128, max_num_seqs=2)
    sp = jspec.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = jspec.LLM(**kw).generate(["def add(a, b):\n"], sp)[0].metrics.spec_counters()
    with TestClient(create_app(jspec.LLM(**kw).engine)) as c:
        r = c.post("/v1/completions", json={"prompt": "def add(a, b):\n", "max_tokens": 24, "temperature": 0,
                                            "ignore_eos": True})
    got = r.json()["usage"]["speculative_decoding"]
    assert got["num_drafts"] > 0 and got == want
    assert r.json()["model"] == "jspec-stdlib-10m"  # no model given: the family's name (cli.FAMILY_NAME)
    assert got["mean_acceptance_length"] == 1 + got["num_accepted_tokens"] / got["num_drafts"]


def test_api_key_from_vllm_env(monkeypatch):
    from jspec import envs

    monkeypatch.setenv("VLLM_API_KEY", "k")
    assert envs.VLLM_API_KEY == "k"
    monkeypatch.delenv("VLLM_API_KEY")
    assert envs.VLLM_API_KEY is None


def _hf_chat_ids(tok, msgs, **kw):
    ids = tok.apply_chat_template(msgs, tokenize=True, **kw)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_tokenize_and_detokenize(client, llm):
    tok = llm.get_tokenizer()
    text = "The quick brown fox"
    r = client.post("/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    want = list(tok(text)["input_ids"])
    assert r == {"count": len(want), "max_model_len": llm.engine.max_model_len, "tokens": want,
                 "token_strs": tok.convert_ids_to_tokens(want)}
    done = client.post("/v1/completions", headers=AUTH, json={"prompt": text, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == r["count"]  # what a completion of that prompt reads
    r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == list(tok(text, add_special_tokens=False)["input_ids"]) and r["token_strs"] is None

    msgs = [{"role": "user", "content": "Hi there"}]
    r = client.post("/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == _hf_chat_ids(tok, msgs, add_generation_prompt=True)
    done = client.post("/v1/chat/completions", headers=AUTH, json={"messages": msgs, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == r["count"]
    prefill = msgs + [{"role": "assistant", "content": "Hello, I am"}]
    body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    want = _hf_chat_ids(tok, prefill, continue_final_message=True)
    assert client.post("/tokenize", json=body).json()["tokens"] == want
    done = client.post("/v1/chat/completions", headers=AUTH, json=body | {"max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == len(want)
    r = client.post("/tokenize", json={"messages": prefill, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"

    ids = list(tok(text)["input_ids"])
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tok.decode(ids)}
    r = client.post("/detokenize", json={"tokens": [1, 10**7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = client.post("/tokenize", json={"model": "other", "prompt": text})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post("/tokenize", json={"prompt": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"



def test_chat_template_fault_is_the_servers_500_and_a_bad_template_the_clients_400(client, llm, monkeypatch):
    """A template the request brings (or its messages) that fails is a 400; the server
    failing to render at all (jinja2 missing) a 500 naming the cause, not the client's fault."""
    msgs = [{"role": "user", "content": "Hi"}]
    for template, frag in [("{% for m in messages %}{{ m['content'] }", "Could not apply the chat template"),
                           ("{{ raise_exception('roles must alternate') }}", "roles must alternate")]:
        r = client.post("/v1/chat/completions", headers=AUTH, json={"messages": msgs, "chat_template": template})
        assert r.status_code == 400 and frag in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "messages"

    def no_jinja(*a, **kw):
        raise ImportError("apply_chat_template requires jinja2 to be installed")

    monkeypatch.setattr(llm.get_tokenizer(), "apply_chat_template", no_jinja)
    for path, body in [("/v1/chat/completions", {"messages": msgs, "max_tokens": 1}), ("/tokenize", {"messages": msgs})]:
        r = client.post(path, headers=AUTH, json=body)
        err = r.json()["error"]
        assert r.status_code == 500 and err["type"] == "internal_server_error", r.text
        assert "ImportError: apply_chat_template requires jinja2" in err["message"]
