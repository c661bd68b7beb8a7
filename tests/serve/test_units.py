"""Fast unit tests of the server's pieces that need no engine: request validation and the
incremental detokenizer (on the default model's byte-level tokenizer)."""

from __future__ import annotations

import json
import re

import pytest

from jspec.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, check_unsupported, parse_request
from jspec.serve.text import Detokenizer


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from tests.helpers.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def _stream(tok, ids, stop=None):
    d = Detokenizer(tok, stop)
    pieces = []
    for n in range(1, len(ids) + 1):
        pieces.append(d.update(ids[:n], finished=n == len(ids)))
        if d.stopped:
            break
    return pieces, d


def test_multibyte_characters_are_never_split(tok):
    text = "héllo € 😀 ok"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # byte-level: multi-byte chars span tokens
    pieces, d = _stream(tok, ids)
    assert "".join(pieces) == text == d.sent
    assert all("\ufffd" not in p for p in pieces)


def test_invalid_bytes_still_stream(tok):
    ids = [249] * 5 + tok.encode("ab")  # 0xF9 is never valid UTF-8: final U+FFFD each
    pieces, _ = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert sum(1 for p in pieces if p) >= 5  # not all held back to the end


def test_stop_string_is_cut_and_never_half_sent(tok):
    ids = tok.encode("one two STOP three")
    pieces, d = _stream(tok, ids, stop=["STOP", "zzz"])
    assert d.stopped and "".join(pieces) == "one two "
    assert not any("S" in p for p in pieces)


def test_wrong_types_are_400_with_the_field_named():
    for body, param in [({"prompt": "x", "max_tokens": "5"}, "max_tokens"), ({"prompt": "x", "stream": 1}, "stream"),
                        ({"prompt": 3}, "prompt"), ({"prompt": "x", "stop": 5}, "stop"),
                        ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options")]:
        with pytest.raises(APIError) as e:
            parse_request(json.dumps(body).encode(), CompletionRequest)
        assert e.value.status == 400 and e.value.param == param, (body, e.value.message)
    with pytest.raises(APIError, match="Malformed JSON"):
        parse_request(b"{", CompletionRequest)
    req, ignored = parse_request(b'{"prompt": "x", "temperature": 0, "foo": 1}', CompletionRequest)
    assert req.temperature == 0.0 and ignored == ["foo"]  # ints are fine for floats; unknown ignored
    req, _ = parse_request(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}',
                           ChatCompletionRequest)
    with pytest.raises(APIError, match="'best_of'"):
        check_unsupported(parse_request(b'{"prompt": "x", "best_of": 3}', CompletionRequest)[0])
    check_unsupported(parse_request(b'{"prompt": "x", "n": 3, "logprobs": 2, "echo": true}', CompletionRequest)[0])


# ------------------------------------------------------------------ the command line
def test_help_shows_the_defaults():
    from jspec.serve import cli

    text = " ".join(cli.build_parser().format_help().split())  # unwrapped
    for want in ("--host HOST address to listen on (default: 127.0.0.1)", "--port PORT port to listen on (default: 8000)",
                 "most requests running at once (default: 8)", "(default: 0.9)", "KV pages (default: from",
                 f"{cli.FAMILY_NAME} when no model is given"):
        assert want in text, want
    assert not re.search(r"\(default[^)]*\) \(default", text)  # a default given in words is not repeated
    assert "(default: None)" not in text and "(default: False)" not in text


def test_served_model_name_is_the_model_argument_as_given():
    """vLLM's: the --model (or positional) string exactly as given, unless --served-model-name
    names others; without a model the engine's (the family's folder name)."""
    from jspec import family
    from jspec.serve import cli

    p = cli.build_parser()
    for argv in (["--model", "/tmp/s8b/target-llama"], ["/tmp/s8b/target-llama"]):
        assert cli.served_model_names(p.parse_args(argv)) == ["/tmp/s8b/target-llama"]
    assert cli.served_model_names(p.parse_args(["./m/", "--served-model-name", "a", "b"])) == ["a", "b"]
    assert cli.served_model_names(p.parse_args([])) is None
    assert cli.FAMILY_NAME == "jspec-stdlib-10m" == __import__("os").path.basename(family.TARGET)
    # --disable-log-stats is the server's own (vLLM's flag), no engine argument
    args = p.parse_args(["m", "--disable-log-stats"])
    assert args.disable_log_stats and "disable_log_stats" not in cli.engine_kwargs(args)


def test_serving_line_names_the_drafter():
    from types import SimpleNamespace as NS

    from jspec import family
    from jspec.serve import cli

    assert cli.describe_drafter(NS(spec=None, K=0)) == "no drafter"
    fam = NS(spec=NS(method="dflash", model=f"{family.ROOT}/dflash"), K=4)
    assert cli.describe_drafter(fam) == "speculative decoding: dflash, K=4, the embedded family's drafter"
    own = NS(spec=NS(method="eagle3", model="/ckpt/eagle3"), K=3)
    assert cli.describe_drafter(own) == "speculative decoding: eagle3, K=3, drafter /ckpt/eagle3"
    ngram = NS(spec=NS(method="ngram", model=None, prompt_lookup_min=2, prompt_lookup_max=4), K=5)
    assert cli.describe_drafter(ngram) == "speculative decoding: ngram, K=5, prompt lookup 2..4"


def test_jax_missing_libtpu_line_is_filtered(caplog):
    import logging

    from jspec.serve import cli

    cli.setup_logging("info")
    jax_log = logging.getLogger("jax._src.xla_bridge")
    with caplog.at_level(logging.INFO, logger="jax._src.xla_bridge"):
        jax_log.info("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: libtpu.so: cannot "
                     "open shared object file: No such file or directory")
        jax_log.info("Unable to initialize backend 'cuda': no CUDA driver")  # says why there is no GPU: kept
    assert "'tpu'" not in caplog.text and "'cuda'" in caplog.text


# ------------------------------------------------------------------- the stats line
def _stats(prompt=0, gen=0, running=0, waiting=0, free=100, drafts=0, drafted=0, accepted=0, per_pos=(), hits=0,
           queries=0):
    return {"num_prompt_tokens": prompt, "num_generation_tokens": gen, "num_running": running, "num_waiting": waiting,
            "num_free_pages": free, "num_pages": 100, "num_drafts": drafts, "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted, "accepted_per_position": list(per_pos),
            "prefix_cache_hit_tokens": hits, "prefix_cache_query_tokens": queries}


def test_stats_line_every_interval_with_work_and_quiet_when_idle(caplog):
    import logging

    from jspec.serve.metrics import StatLogger

    log = StatLogger(interval=10.0, speculating=True)
    with caplog.at_level(logging.INFO, logger="jspec.serve.stats"):
        assert log.observe(_stats(), 0.0) == []  # the start of the first interval
        assert log.observe(_stats(prompt=50, gen=5, running=2), 5.0) == []  # not yet 10 s
        lines = log.observe(_stats(prompt=100, gen=200, running=2, waiting=1, free=75, drafts=40, drafted=120,
                                   accepted=60, per_pos=(30, 20, 10), hits=32, queries=100), 10.0)
        assert lines == [
            "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 2 reqs, "
            "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 32.0%",
            "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 6.00 tokens/s, Drafted "
            "throughput: 12.00 tokens/s, Accepted: 60 tokens, Drafted: 120 tokens, Per-position acceptance rate: "
            "0.750, 0.500, 0.250, Avg Draft acceptance rate: 50.0%"]
        assert caplog.text.count("Avg prompt throughput") == 1
        # the interval's requests finished: one more line for it, then nothing while idle
        done = _stats(prompt=100, gen=230, free=100, drafts=50, drafted=150, accepted=70, per_pos=(35, 25, 10),
                      hits=32, queries=100)
        last = log.observe(done, 20.0)
        assert last[0].startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 3.0 tokens/s, "
                                  "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: "
                                  "32.0%")
        assert "Per-position acceptance rate: 0.500, 0.500, 0.000" in last[1]
        assert log.observe(done, 30.0) == [] and log.observe(done, 45.0) == []
    assert caplog.text.count("Avg prompt throughput") == 2
    plain = StatLogger(interval=1.0, speculating=False, kv_label="GPU KV cache usage")
    plain.observe(_stats(), 0.0)
    line, = plain.observe(_stats(gen=10, running=1, drafts=3, drafted=3), 1.0)  # no SpecDecoding line without a drafter
    assert "GPU KV cache usage: 0.0%" in line
