"""vLLM's request extensions that change what is generated or returned, on the app in-process
over the embedded family (its tokenizer adds a BOS, so add_special_tokens shows), each
checked against the model's HF tokenizer: skip_special_tokens, add_special_tokens, a
request's chat_template, truncate_prompt_tokens; use_beam_search and a non-zero priority
are refused by name."""

from __future__ import annotations

import json

import pytest

import jspec


@pytest.fixture(scope="module")
def llm():
    return jspec.LLM(max_model_len=128, max_num_seqs=2)  # the shapes of tests/e2e/test_llm_api.py


@pytest.fixture(scope="module")
def client(llm):
    from starlette.testclient import TestClient

    from jspec.serve.app import create_app

    with TestClient(create_app(llm.engine, "family")) as c:
        yield c


def test_vllm_prompt_and_text_fields(client, llm):
    tok = llm.get_tokenizer()
    bos = tok.bos_token_id

    def complete(**body):
        r = client.post("/v1/completions", json={"max_tokens": 3, "temperature": 0} | body)
        assert r.status_code == 200, r.text
        return r.json()

    # a special token forced as every output token: left out of the text unless asked
    body = {"prompt": "Hi", "allowed_token_ids": [bos], "ignore_eos": True}
    assert complete(**body)["choices"][0]["text"] == ""
    kept = complete(**body, skip_special_tokens=False)["choices"][0]["text"]
    assert kept == tok.decode([bos] * 3, skip_special_tokens=False) == tok.bos_token * 3
    with client.stream("POST", "/v1/completions",
                       json={"max_tokens": 3, "temperature": 0, "stream": True, "skip_special_tokens": False} | body) as r:
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                           if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert streamed == kept

    text = "The quick brown fox"
    assert len(tok(text)["input_ids"]) == len(tok(text, add_special_tokens=False)["input_ids"]) + 1  # a BOS
    assert complete(prompt=text)["usage"]["prompt_tokens"] == len(tok(text)["input_ids"])
    assert complete(prompt=text, add_special_tokens=False)["usage"]["prompt_tokens"] == \
        len(tok(text, add_special_tokens=False)["input_ids"])

    msgs = [{"role": "user", "content": "Hi there"}]
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"

    def chat(**body):
        r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1} | body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert chat(add_special_tokens=True) == len(tok(rendered)["input_ids"]) == chat() + 1  # a second BOS
    want = tok.apply_chat_template(msgs, chat_template=template, tokenize=True, add_generation_prompt=True)
    assert chat(chat_template=template) == len(want["input_ids"] if hasattr(want, "keys") else want)

    ids = list(tok(text)["input_ids"])
    cut = complete(prompt=ids, truncate_prompt_tokens=3, return_token_ids=True)
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["choices"][0]["token_ids"] == complete(prompt=ids[-3:], return_token_ids=True)["choices"][0]["token_ids"]
    for bad, param in [({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                       ({"use_beam_search": True}, "use_beam_search"), ({"priority": 1}, "priority")]:
        r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 2} | bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
