"""vLLM's engine arguments and server flags (jspec/vllm_args.py): a vLLM user keeps their
keys and flags. Each is honoured under jspec's name, accepted with a log line saying why it
changes nothing, or refused with an error naming the key and the reason."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil

import httpx
import openai
import pytest

import jspec
from jspec import vllm_args
from jspec.checkpoint.model_files import TOKENIZER_FILES
from jspec.engine.llm_engine import EngineConfig
from jspec.serve import cli
from tests.helpers.serve import ENGINE_KWARGS, TINY_MODEL, start_server

KNOWN = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
# A chat template unlike the tiny model's own (which wraps turns in role markers).
TEMPLATE = "{% for m in messages %}{{ m['content'] }} | {% endfor %}answer:"
CHAT = [{"role": "user", "content": "the quick brown fox"}]


def test_translate_renames_aliases_and_refusals(caplog):
    with caplog.at_level(logging.INFO, logger="jspec"):
        out = vllm_args.translate(dict(block_size=32, num_gpu_blocks_override=100, dtype="half", max_num_seqs=4,
                                       trust_remote_code=True, enforce_eager=True, kv_cache_dtype="auto",
                                       quantization=None, pipeline_parallel_size=1), KNOWN)
    assert out == dict(page_size=32, num_pages=100, dtype="float16", max_num_seqs=4, quantization=None,
                       kv_cache_dtype="auto")
    assert vllm_args.translate(dict(quantization="fp8"), KNOWN) == dict(quantization="fp8")  # FP8 weights
    assert vllm_args.translate(dict(kv_cache_dtype="fp8"), KNOWN) == dict(kv_cache_dtype="fp8")  # an FP8 KV cache
    assert "trust_remote_code=True has no effect in jspec" in caplog.text
    assert "enforce_eager=True has no effect in jspec" in caplog.text
    assert vllm_args.translate(dict(dtype="float"), KNOWN) == dict(dtype="float32")
    for bad, match in [(dict(kv_cache_dtype="fp8_e5m2"), r"kv_cache_dtype='fp8_e5m2' is not supported: the target's KV"),
                       (dict(quantization="awq"), r"quantization='awq' is not supported: jspec serves FP8 weights"),
                       (dict(pipeline_parallel_size=2), r"pipeline_parallel_size=2 is not supported: .*tensor"),
                       (dict(revision="main"), r"revision='main' is not supported: jspec loads local folders"),
                       (dict(max_num_seq=4), r"unknown engine argument 'max_num_seq'; did you mean 'max_num_seqs'\?"),
                       (dict(block_size=16, page_size=8), r"block_size=16 \(vLLM's name for page_size\) contradicts")]:
        with pytest.raises(ValueError, match=match):
            vllm_args.translate(bad, KNOWN)


def test_llm_takes_vllm_keys():
    """The engine built from vLLM's keys has the same EngineConfig as the one built from
    jspec's names; refused values fail before anything loads."""
    kw = dict(ENGINE_KWARGS)
    model = kw.pop("model")
    page = kw.pop("page_size")
    vllm = jspec.LLM(model, block_size=page, num_gpu_blocks_override=48, dtype="float", trust_remote_code=True,
                     enforce_eager=True, swap_space=4, enable_chunked_prefill=True, kv_cache_dtype="auto", **kw)
    mine = jspec.LLM(model, page_size=page, num_pages=48, dtype="float32", **kw)
    assert vllm.engine.config == mine.engine.config
    assert vllm.engine.num_pages == 48 and vllm.engine.config.page_size == page
    with pytest.raises(ValueError, match="quantization='gptq' is not supported"):
        jspec.LLM(model, quantization="gptq")


def test_tokenizer_folder(tmp_path):
    """tokenizer= (vLLM's key) loads the tokenizer from that folder; a folder without one is
    an error naming it."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for f in TOKENIZER_FILES:
        if os.path.exists(src := os.path.join(TINY_MODEL, f)):
            shutil.copy(src, tok_dir)
    tok = jspec.LLM(TINY_MODEL, tokenizer=str(tok_dir), max_model_len=64, num_pages=16).get_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(tok_dir))  # the folder's template now differs from the model's
    llm = jspec.LLM(TINY_MODEL, tokenizer=str(tok_dir), max_model_len=64, num_pages=16)
    assert llm.get_tokenizer().chat_template == TEMPLATE
    assert jspec.LLM(TINY_MODEL, max_model_len=64, num_pages=16).get_tokenizer().chat_template != TEMPLATE
    with pytest.raises(ValueError, match=r"tokenizer='.*empty': no tokenizer in that folder"):
        jspec.LLM(TINY_MODEL, tokenizer=str(tmp_path / "empty"))


def test_chat_with_a_template_of_its_own():
    llm = jspec.LLM(**ENGINE_KWARGS)
    sp = jspec.SamplingParams(temperature=0.0, max_tokens=6)
    tok = llm.get_tokenizer()
    out = llm.chat(CHAT, sp, chat_template=TEMPLATE)[0]
    want_ids = tok("the quick brown fox | answer:")["input_ids"]
    assert out.prompt_token_ids == want_ids
    assert out.outputs[0].token_ids == llm.generate([want_ids], sp)[0].outputs[0].token_ids
    assert llm.chat(CHAT, sp)[0].prompt_token_ids != want_ids  # the model's own template otherwise


def test_cli_flags(capsys):
    p = cli.build_parser()
    args = p.parse_args([TINY_MODEL, "--block-size", "32", "--num-gpu-blocks-override", "64", "--dtype", "half",
                         "--trust-remote-code", "--enforce-eager", "--no-enable-prefix-caching", "--async-scheduling",
                         "--kv-cache-dtype", "auto", "--disable-log-requests", "--swap-space", "4"])
    kw = vllm_args.translate(cli.engine_kwargs(args), KNOWN)
    assert (args.model_tag, kw["page_size"], kw["num_pages"], kw["dtype"]) == (TINY_MODEL, 32, 64, "float16")
    assert kw["enable_prefix_caching"] is False and kw["async_scheduling"] is True
    assert vllm_args.translate(cli.engine_kwargs(p.parse_args([TINY_MODEL, "-q", "fp8"])), KNOWN)["quantization"] == "fp8"
    assert not {"trust_remote_code", "enforce_eager", "swap_space"} & set(kw) and kw["kv_cache_dtype"] == "auto"
    assert cli.engine_kwargs(p.parse_args(["--enable-prefix-caching"]))["enable_prefix_caching"] is True
    for argv, match in [([TINY_MODEL, "--kv-cache-dtype", "fp8_e5m2"], "kv_cache_dtype='fp8_e5m2' is not supported"),
                        ([TINY_MODEL, "-q", "awq"], "quantization='awq' is not supported"),
                        (["a", "--model", "b"], "the model is given twice"),
                        ([TINY_MODEL, "--chat-template", "no/such/file.jinja"], "no such file, and not a Jinja")]:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and match in capsys.readouterr().err


def test_server_started_the_vllm_way(tmp_path):
    """`python -m jspec.serve MODEL` with vLLM's flags serves the model: the chat reply
    under --chat-template is LLM.chat's under the same template; tool_choice "auto" is
    served under --enable-auto-tool-choice --tool-call-parser hermes; --served-model-name
    names it (every name accepted, the first reported, the folder no longer)."""
    tpl = tmp_path / "chat.jinja"
    tpl.write_text(TEMPLATE)
    args = [TINY_MODEL, "--max-num-seqs", "16", "--max-model-len", "128", "--block-size", "16", "--dtype", "float",
            "--trust-remote-code", "--enforce-eager", "--disable-log-requests", "--kv-cache-dtype", "auto",
            "--chat-template", str(tpl), "--uvicorn-log-level", "warning", "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes", "--served-model-name", "jspec-tiny", "alias"]
    srv = start_server(engine_args=args)
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["jspec-tiny", "alias"]
        r = client.chat.completions.create(model="alias", messages=CHAT, max_tokens=6, temperature=0)
        assert r.model == "jspec-tiny"  # the first name (vLLM's documented rule)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=TINY_MODEL, messages=CHAT, max_tokens=1)
        assert f"serving {TINY_MODEL} as jspec-tiny, alias on " in srv.log()
        got = r.choices[0].message.content
        llm = jspec.LLM(**ENGINE_KWARGS)
        want = llm.chat(CHAT, jspec.SamplingParams(temperature=0.0, max_tokens=6), chat_template=TEMPLATE)[0]
        assert got == want.outputs[0].text
        call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60,
                       json={"messages": CHAT, "tools": tools, "max_tokens": 50, "temperature": 0,
                             "structured_outputs": {"choice": [call]}})  # the tiny model writes the call
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
        assert "trust_remote_code=True has no effect in jspec" in srv.log()
    finally:
        assert srv.stop() == 0

