"""jspec.LLM as a vLLM user reaches it: dtype "auto" follows the checkpoint (float32 on a CPU),
user errors name the problem, LLM.chat goes through the model's chat template,
LLM.get_tokenizer, vLLM's prompt dicts and cache_salt."""

from __future__ import annotations

import os

import numpy as np
import pytest

import jspec


def test_dtype_auto_follows_the_checkpoint_on_accelerators_and_is_float32_on_a_cpu(tmp_path):
    import jax
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jspec.checkpoint.target import auto_dtype

    assert [auto_dtype(d, b) for d in ("bfloat16", "float16", "float32") for b in ("gpu", "tpu")] == [
        "bfloat16", "bfloat16", "float16", "float16", "float32", "float32"]
    assert {auto_dtype(d, "cpu") for d in ("bfloat16", "float16", "float32")} == {"float32"}
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    folder = str(tmp_path / "bf16")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    want = auto_dtype("bfloat16", jax.default_backend())
    eng = jspec.LLM(folder, max_model_len=32, num_pages=8).engine
    assert eng.config.dtype == want
    assert {str(x.dtype) for x in jax.tree.leaves(eng.runner.params)} == {want}
    assert str(eng.runner.kv.k[0].dtype) == want
    # an explicit dtype still wins
    assert jspec.LLM(folder, dtype="bfloat16", max_model_len=32, num_pages=8).engine.config.dtype == "bfloat16"


def test_user_errors_are_one_line(tmp_path):
    """Bad input to the CLI is an error line naming it (exit 2), no traceback; the API's
    empty prompt is a ValueError, as the server's 400, and no prompts give no outputs."""
    import subprocess
    import sys

    for args, needle in ((["jspec", "--speculative-config", "{bad"], "--speculative-config is not valid JSON"),
                         (["jspec", "--model", str(tmp_path / "nonexistent")], "is not a directory"),
                         (["jspec", "--max-tokens", "-5"], "max_tokens must be an integer >= 1"),
                         (["jspec.serve", "--model", str(tmp_path / "nonexistent")], "is not a directory")):
        r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-2000:])
    llm = jspec.LLM(max_model_len=64, max_num_seqs=1)
    assert llm.generate([]) == []
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("")


@pytest.fixture(scope="module")
def llm():
    return jspec.LLM(max_model_len=128, max_num_seqs=2)


def test_chat_uses_the_chat_template(llm):
    tok = llm.get_tokenizer()
    assert tok is llm.engine.tokenizer
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    sp = jspec.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = llm.generate([ids], sp)[0].token_ids
    one = llm.chat(conv, sp)
    two = llm.chat([conv, conv[1:]], sp)
    assert len(one) == 1 and one[0].token_ids == want and one[0].prompt_token_ids == ids
    assert len(two) == 2 and two[0].token_ids == want and two[1].prompt_token_ids != ids
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], sp)
    assert np.all([isinstance(t, int) for t in one[0].token_ids])


def test_chat_continues_a_message_and_passes_tools(llm):
    """vLLM's LLM.chat arguments: continue_final_message, tools (a template that renders tools
    sees them), as transformers' apply_chat_template takes them."""
    tok = llm.get_tokenizer()
    sp = jspec.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    conv = [{"role": "user", "content": "Write a loop"}, {"role": "assistant", "content": "for i in"}]
    ids = tok.apply_chat_template(conv, continue_final_message=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    out = llm.chat(conv, sp, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt_token_ids == ids and out.token_ids == llm.generate([ids], sp)[0].token_ids
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    template = "{% for t in tools or [] %}tool {{ t['function']['name'] }}\n{% endfor %}{{ messages[0]['content'] }}"
    with_tools = llm.chat(conv[:1], sp, chat_template=template, tools=tools)[0].prompt_token_ids
    assert tok.decode(with_tools).endswith("tool get_time\nWrite a loop")
    assert len(llm.chat(conv[:1], sp, chat_template=template)[0].prompt_token_ids) < len(with_tools)


def test_vllm_prompt_dicts(llm):
    """vLLM's TextPrompt / TokensPrompt give what the string / token ids give; a dict jspec
    cannot take is a ValueError naming the key, and the call queues none of its prompts."""
    sp = jspec.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    text = "def main():"
    ids = list(llm.get_tokenizer().encode(text))
    want = llm.generate([text], sp)[0]
    a, b = llm.generate([jspec.TextPrompt(prompt=text), jspec.TokensPrompt(prompt_token_ids=ids)], sp)
    assert a.token_ids == want.token_ids == b.token_ids
    assert a.prompt == text and b.prompt is None and b.prompt_token_ids == ids
    (one,) = llm.generate({"prompt_token_ids": ids, "cache_salt": "s"}, sp)  # a single dict, not a list
    assert one.token_ids == want.token_ids
    for bad, match in [({"prompt": text, "multi_modal_data": {"image": None}}, r"\['multi_modal_data'\].*text-only"),
                       ({"prompt": text, "prompt_token_ids": ids}, "exactly one of 'prompt'"),
                       ({"prompt_token_ids": ids, "max_tokens": 3}, r"unknown prompt keys \['max_tokens'\]"),
                       ({"prompt": ids}, "'prompt' must be a string"),
                       ({"prompt": text, "cache_salt": ""}, "cache_salt must be a non-empty string")]:
        with pytest.raises(ValueError, match=match):
            llm.generate([text, bad], sp)
        assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="contradicts the prompt's cache_salt"):
        llm.engine.add_request("x", {"prompt": text, "cache_salt": "a"}, sp, cache_salt="b")


def test_cache_salt_keeps_cached_prefixes_apart(llm):
    """vLLM's cache_salt: a prompt reuses cached pages of an earlier one only under the same salt."""
    blocks = llm.engine.blocks
    ids = list(range(100, 150))  # three full pages of 16
    sp = jspec.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": ids, "cache_salt": "a"}], sp)[0]
    want = first.token_ids
    hits = blocks.hits
    other = llm.generate([{"prompt_token_ids": ids, "cache_salt": "b"}], sp)[0]
    plain = llm.generate([ids], sp)[0]
    assert other.token_ids == plain.token_ids == want
    assert blocks.hits == hits and first.num_cached_tokens == other.num_cached_tokens == plain.num_cached_tokens == 0
    again = llm.generate([{"prompt_token_ids": ids, "cache_salt": "a"}], sp)[0]
    assert again.token_ids == want and blocks.hits == hits + 3
    assert again.num_cached_tokens == 3 * 16  # vLLM's RequestOutput.num_cached_tokens


def test_max_model_len_beyond_the_models_positions(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = str(tmp_path / "m")
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=64)).save_pretrained(folder)
    for var in ("JSPEC_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="max_model_len=96 is greater than the model's max_position_embeddings=64"):
        jspec.LLM(folder, max_model_len=96, num_pages=16)
    assert jspec.LLM(folder, max_model_len=64, num_pages=16).engine.max_model_len == 64
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's override, honoured
    assert jspec.LLM(folder, max_model_len=96, num_pages=16).engine.max_model_len == 96


def test_llm_takes_engine_config_fields_only():
    """jspec.LLM passes its keyword arguments to EngineConfig (one set of defaults); a name
    EngineConfig does not have is an error naming it, before anything loads."""
    with pytest.raises(ValueError, match=r"unknown engine argument 'max_num_seq'; did you mean 'max_num_seqs'"):
        jspec.LLM(max_num_seq=4)


_CACHE_PROBE = """
import json, sys
import jax, jax.monitoring
import jspec
hits = []
jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event) if event.endswith("/cache_hits") else None)
jnp_first = jax.jit(lambda x: x + 1)(1)  # a compilation of the caller's before the engine's
llm = jspec.LLM(sys.argv[1], max_model_len=64, num_pages=16, max_num_seqs=2)
out = llm.generate([[1, 2, 3]], jspec.SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
print(json.dumps({"hits": len(hits), "dir": jax.config.jax_compilation_cache_dir, "tokens": list(out),
                  "max_size": jax.config.jax_compilation_cache_max_size}))
"""


def test_compiled_steps_persist_across_processes(tmp_path):
    """jspec.LLM turns jax's persistent compilation cache on in $JSPEC_CACHE/xla (vLLM keeps
    its compiled graphs too): a second process loads the steps the first compiled, with the
    same outputs, even after a compilation of its own came first; the cache keeps under
    JSPEC_COMPILATION_CACHE_MAX_GB (10 GiB by default); JSPEC_COMPILATION_CACHE=0 and a cache
    the user configured are respected."""
    import json
    import subprocess
    import sys

    from tests.helpers.serve import TINY_MODEL

    def run(**env):
        base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
        base.update({"JSPEC_CACHE": str(tmp_path / "jc"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **env})
        r = subprocess.run([sys.executable, "-c", _CACHE_PROBE, TINY_MODEL], env=base, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["dir"] == second["dir"] == str(tmp_path / "jc" / "xla")
    assert os.listdir(first["dir"])
    assert second["hits"] > first["hits"] and second["tokens"] == first["tokens"]
    assert first["max_size"] == 10 * 2**30
    cap = 64 * 1024  # under the tiny model's 246 KB of entries: what does not fit is not kept
    small = run(JSPEC_COMPILATION_CACHE_MAX_GB=str(cap / 2**30), JSPEC_CACHE=str(tmp_path / "small"))
    entries = [e for e in os.scandir(small["dir"]) if e.name.endswith("-cache")]
    assert entries and sum(e.stat().st_size for e in entries) <= cap and small["tokens"] == first["tokens"]
    off = run(JSPEC_COMPILATION_CACHE="0", JSPEC_CACHE=str(tmp_path / "off"))
    assert off["dir"] is None and not (tmp_path / "off" / "xla").exists() and off["tokens"] == first["tokens"]
    mine = run(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "mine"))
    assert mine["dir"] == str(tmp_path / "mine") and os.listdir(tmp_path / "mine")


def test_cache_entries_without_access_time_are_repaired(tmp_path):
    """An entry with no access-time file (written with no size limit, or by a process killed
    between its two writes) makes jax's LRU cache fail every later write; jspec gives it
    one when it turns the cache on, after which jax's own cache takes new entries again."""
    from jax._src.lru_cache import LRUCache

    from jspec.compile_cache import backfill_access_times

    (tmp_path / "old-cache").write_bytes(b"x" * 10)
    cache = LRUCache(str(tmp_path), max_size=1 << 20)
    with pytest.raises(FileNotFoundError):
        cache.put("new", b"y")
    assert backfill_access_times(str(tmp_path)) == 1 and backfill_access_times(str(tmp_path)) == 0
    cache.put("new", b"y")
    assert cache.get("old") == b"x" * 10 and cache.get("new") == b"y"
    assert backfill_access_times(str(tmp_path / "missing")) == 0
