"""OpenAI's prompt arrays on /v1/completions (what lm-eval's local-completions and other
batching clients send): each prompt runs as its own engine request, choice i * n + j is
prompt i's j-th sample (vLLM's numbering), usage sums the prompts; each choice carries
vLLM's stop_reason and, with return_token_ids, its prompt's token ids. References: jspec.LLM
on the same engine, one prompt at a time, before the server starts."""

from __future__ import annotations

import time

import openai
import pytest

import jspec
from tests.helpers.serve import ENGINE_KWARGS

TEXTS = ["The quick brown fox", "Once upon a time, in a land far away"]
IDS = [[5, 6, 7, 8, 9], [40, 41, 42]]
SP = jspec.SamplingParams


@pytest.fixture(scope="module")
def setup():
    from starlette.testclient import TestClient

    from jspec.serve.app import create_app

    llm = jspec.LLM(**ENGINE_KWARGS)
    sampled = [llm.generate([p], SP(temperature=1.0, seed=11, n=2, max_tokens=6, ignore_eos=True))[0] for p in TEXTS]
    greedy = [llm.generate([p], SP(temperature=0, max_tokens=8, ignore_eos=True))[0] for p in IDS]
    stop_id = greedy[0].token_ids[2]  # prompt 0 stops at its third token
    stopped = [llm.generate([p], SP(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id]))[0]
               for p in IDS]
    ref = {"sampled": sampled, "stopped": stopped, "stop_id": stop_id,
           "prompt_texts": [llm.get_tokenizer().decode(p) for p in IDS]}
    with TestClient(create_app(llm.engine, "tiny")) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http), http, ref


def test_text_prompts_with_n_samples(setup):
    client, _, ref = setup
    kw = dict(model="tiny", prompt=TEXTS, max_tokens=6, temperature=1.0, seed=11, n=2,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        want = ref["sampled"][c.index // 2]
        assert c.text == want.outputs[c.index % 2].text
        assert c.model_extra["token_ids"] == want.outputs[c.index % 2].token_ids
        assert c.model_extra["prompt_token_ids"] == want.prompt_token_ids
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in ref["sampled"])
    assert r.usage.completion_tokens == 4 * 6
    texts, ids, last = [""] * 4, set(), None  # one response id over all the prompts' chunks
    with client.completions.create(stream=True, stream_options={"include_usage": True}, **kw) as stream:
        for chunk in stream:
            ids.add(chunk.id)
            for c in chunk.choices:
                texts[c.index] += c.text
            last = chunk
    assert texts == [c.text for c in r.choices]
    assert len(ids) == 1
    assert last.usage.completion_tokens == 24 and last.usage.prompt_tokens == r.usage.prompt_tokens


def test_token_prompts_with_stop_reason_and_echo(setup):
    client, _, ref = setup
    r = client.completions.create(model="tiny", prompt=IDS, max_tokens=8, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [ref["stop_id"]]})
    assert len(r.choices) == 2
    for c, want, text in zip(r.choices, ref["stopped"], ref["prompt_texts"]):
        assert c.text == text + want.text  # echo: the prompt's ids decoded, then the completion
        assert c.finish_reason == want.finish_reason
        assert c.model_extra["stop_reason"] == want.outputs[0].stop_reason
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == ref["stop_id"]


def _finished(http, reason: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{") and f'finished_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_bad_prompt_in_the_batch_is_a_400_and_aborts_the_rest(setup):
    """The second prompt is refused by the engine after the first was queued: the first is
    aborted (counted as such), not left to run its 120 tokens for nobody."""
    client, http, _ = setup
    before = _finished(http, "abort"), _finished(http, "length")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[[1, 2, 3], [10**6]], max_tokens=120,
                                  extra_body={"ignore_eos": True})
    assert e.value.body["param"] == "prompt" and "not a token id" in e.value.body["message"]
    eng = http.app.state.jspec.engine
    deadline = time.monotonic() + 10
    while eng.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not eng.has_unfinished_requests()
    assert (_finished(http, "abort"), _finished(http, "length")) == (before[0] + 1, before[1])
