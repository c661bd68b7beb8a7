"""Fast unit tests of the server's pieces that need no engine: request validation and the
incremental detokenizer (on the default model's byte-level tokenizer)."""

from __future__ import annotations

import json

import pytest

from jspec.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, check_unsupported, parse_request
from jspec.serve.text import Detokenizer


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from jspec.default_model import default_model_path

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
