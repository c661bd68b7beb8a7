"""Issue 26 on the server, through the official openai client (in-process app): logprobs
(completions' and chat's shapes) equal jspec.LLM's, ``n`` choices, ``echo`` with prompt
logprobs, vLLM's sampling extensions (penalties, min_tokens, bad_words...) passed through,
bad values a 400 naming the field, the api key accepted and refused."""

from __future__ import annotations

import math

import openai
import pytest

import jspec
from tests.helpers.serve import ENGINE_KWARGS

KEY = "k-123"
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Hi there"}]
EXTRA = {"repetition_penalty": 1.3, "min_tokens": 4, "bad_words": ["e"], "presence_penalty": 0.5}
SP = jspec.SamplingParams


@pytest.fixture(scope="module")
def setup():
    """(openai client, reference outputs computed by jspec.LLM on the same engine first)."""
    from starlette.testclient import TestClient

    from jspec.serve.app import create_app

    llm = jspec.LLM(**ENGINE_KWARGS)
    tok = llm.get_tokenizer()
    chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    ref = {
        "lp": llm.generate([PROMPT], SP(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True))[0],
        "n": llm.generate([PROMPT], SP(temperature=1.0, seed=7, n=2, max_tokens=8, ignore_eos=True))[0],
        "echo": llm.generate([PROMPT], SP(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=2,
                                          ignore_eos=True))[0],
        "chat": llm.generate([chat_ids], SP(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True))[0],
        "extra": llm.generate([PROMPT], SP(temperature=0, max_tokens=10, **EXTRA))[0],
    }
    with TestClient(create_app(llm.engine, "tiny", api_key=KEY)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http), http, ref


def test_completion_logprobs_equal_the_engines(setup):
    client, _, ref = setup
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    want = ref["lp"].outputs[0]
    assert len(lp.tokens) == len(want.token_ids) == r.usage.completion_tokens
    for t, got, top, d in zip(want.token_ids, lp.token_logprobs, lp.top_logprobs, want.logprobs):
        assert math.isclose(got, d[t].logprob, rel_tol=1e-6)
        assert sorted(top.values()) == pytest.approx(sorted(v.logprob for v in d.values()))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == r.choices[0].text


def test_n_choices_streamed_and_whole(setup):
    client, _, ref = setup
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.model_extra["token_ids"] for c in r.choices] == [c.token_ids for c in ref["n"].outputs]
    assert r.choices[0].text != r.choices[1].text and r.usage.completion_tokens == 16
    texts = ["", ""]
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices]


def test_echo_puts_the_prompt_and_its_logprobs_first(setup):
    client, _, ref = setup
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    want = ref["echo"]
    assert c.text == PROMPT + want.text
    n_p = len(want.prompt_token_ids)
    assert len(c.logprobs.tokens) == n_p + len(want.token_ids)
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    for i in range(1, n_p):
        d = want.prompt_logprobs[i]
        assert math.isclose(c.logprobs.token_logprobs[i], d[want.prompt_token_ids[i]].logprob, rel_tol=1e-6)
    # Closed here, not left to the garbage collector: a stream collected later, on the test
    # client's event-loop thread, cannot close its app (PytestUnraisableExceptionWarning).
    with client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                   stream=True, extra_body={"ignore_eos": True}) as stream:
        first = next(iter(stream))
    assert first.choices[0].text == PROMPT  # the stream's first chunk is the prompt


def test_chat_logprobs_shape(setup):
    client, _, ref = setup
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    want = ref["chat"].outputs[0]
    assert len(content) == len(want.token_ids)
    for item, t, d in zip(content, want.token_ids, want.logprobs):
        assert math.isclose(item.logprob, d[t].logprob, rel_tol=1e-6) and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob >= -9999.0
        assert item.bytes == list(item.token.encode())


def test_vllm_extensions_pass_through(setup):
    client, _, ref = setup
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                  presence_penalty=EXTRA["presence_penalty"],
                                  extra_body={k: v for k, v in EXTRA.items() if k != "presence_penalty"} |
                                  {"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == ref["extra"].token_ids


def test_cache_salt_keeps_cached_prefixes_apart(setup):
    """vLLM's cache_salt (completions and chat): a request reuses cached prompt pages only
    under the same salt."""
    client, http, _ = setup
    blocks = http.app.state.jspec.engine.blocks
    prompt = list(range(200, 240))  # two full pages of 16
    texts = []

    def run(salt, chat=False):
        before = blocks.hits
        extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt else {})
        if chat:
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a b c d " * 12}],
                                               max_tokens=3, temperature=0, extra_body=extra)
            texts.append(r.choices[0].message.content)
        else:
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, extra_body=extra)
            texts.append(r.choices[0].text)
        return blocks.hits - before

    assert run("a") == 0 and run("b") == 0 and run(None) == 0 and run("a") == 2
    assert len(set(texts)) == 1
    assert run("c", chat=True) == 0 and run("d", chat=True) == 0 and run("c", chat=True) > 0


def test_prompt_tokens_details_report_cached_tokens(setup):
    """vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, the
    prompt tokens the prefix cache served (off by default, as in vLLM)."""
    client, http, _ = setup
    prompt = list(range(250, 290))  # two full pages of 16, then 8 tokens

    def usage():
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0).usage

    assert usage().prompt_tokens_details is None
    state = http.app.state.jspec
    state.prompt_tokens_details = True
    try:
        again = usage()
        assert again.prompt_tokens == 40 and again.prompt_tokens_details.cached_tokens == 32
        prompt[0] += 1  # another first page: nothing cached
        assert usage().prompt_tokens_details.cached_tokens == 0
    finally:
        state.prompt_tokens_details = False


@pytest.mark.parametrize("kw, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"extra_body": {"min_p": 2}}, "min_p"),
    ({"n": 0}, "n"), ({"logprobs": 99}, "logprobs"), ({"extra_body": {"allowed_token_ids": [10**6]}}, "allowed_token_ids"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"n": 2, "temperature": 0}, "n"), ({"extra_body": {"cache_salt": ""}}, "cache_salt"),
])
def test_bad_values_are_400_naming_the_field(setup, kw, param):
    client, _, _ = setup
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_api_key_accepted_and_refused(setup):
    _, http, _ = setup
    bad = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=http)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    client, _, _ = setup
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices[0].finish_reason == "length"
