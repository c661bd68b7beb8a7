"""gpu_memory_utilization as in vLLM, a share of the whole device (jspec/engine/kv_memory.py):
the first engine of a process sets JAX's pool to it before the backend starts, and the KV
cache gets what the engine's share leaves after its weights and the temporaries' reserve,
within the pool's free bytes. The device is faked (memory statistics), the arithmetic is
jspec's; docs/gpu_check.md has the line that checks it on a GPU."""

from __future__ import annotations

from types import SimpleNamespace as NS

import jax
import pytest

import jspec
from jspec import envs
from jspec.engine import kv_memory

GB = 1 << 30
POOL_VARS = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")


@pytest.fixture
def fresh_backend(monkeypatch):
    """A process whose jax backend has not started, with no pool variables set."""
    for k in POOL_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(kv_memory, "_backend_started", lambda: False)


def test_the_first_engine_sets_jax_pool_to_its_share(fresh_backend, monkeypatch):
    import os

    kv_memory.claim_device_memory(0.8)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8" and envs.XLA_PYTHON_CLIENT_MEM_FRACTION == 0.8
    kv_memory.claim_device_memory(0.5)  # the pool is the process's: set once
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8"


def test_the_users_pool_and_a_started_backend_are_left_alone(fresh_backend, monkeypatch):
    import os

    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    kv_memory.claim_device_memory(0.8)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ and envs.XLA_PYTHON_CLIENT_MEM_FRACTION is None
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR")
    assert envs.XLA_PYTHON_CLIENT_MEM_FRACTION == envs.JAX_DEFAULT_POOL_FRACTION
    monkeypatch.setattr(kv_memory, "_backend_started", lambda: True)
    kv_memory.claim_device_memory(0.8)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "half")
    with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION must be a fraction.*'half'"):
        envs.XLA_PYTHON_CLIENT_MEM_FRACTION  # noqa: B018


@pytest.mark.parametrize("bad", [0, -0.5, 1.5])
def test_a_share_outside_0_1_is_an_error_before_anything_loads(bad):
    with pytest.raises(ValueError, match=f"gpu_memory_utilization must be in \\(0, 1\\].*got {bad}"):
        jspec.LLM("/nonexistent/model", gpu_memory_utilization=bad)


def _pages(monkeypatch, *, fraction, limit, in_use, own, util, logit_rows=0, vocab=1, dtype="float32", kv="auto",
           pages=False):
    """pages_from_memory on a fake GPU, in KV bytes: a one-layer float32 model, 8 bytes a page
    (``pages``: the page count; ``dtype``, ``kv``: the model's dtype and kv_cache_dtype)."""
    if fraction is None:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    else:
        monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", str(fraction))
    dev = NS(memory_stats=lambda: {"bytes_limit": limit, "bytes_in_use": in_use})
    monkeypatch.setattr(jax, "devices", lambda *a: [dev])
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [dev])  # kv_memory reads this process's
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    c = NS(max_num_seqs=1, page_size=1, dtype=dtype, gpu_memory_utilization=util, kv_cache_dtype=kv)
    mc = NS(num_layers=1, num_kv_heads=1, head_dim=1, vocab_size=vocab)
    par = NS(local_kv_heads=lambda h, draft=False: h)
    n = kv_memory.pages_from_memory(c, mc, None, par, pages_per_seq=1, own_bytes=own, logit_rows=logit_rows)
    return n if pages else n * 8


def test_an_fp8_kv_cache_holds_twice_the_pages(monkeypatch):
    """kv_cache_dtype="fp8" (a byte a value) on a bf16 model: twice the pages of the bf16
    cache in the same share; "fp8_e5m2" is an error naming the key."""
    kw = dict(fraction=0.9, limit=72 * GB, in_use=16 * GB, own=16 * GB, util=0.9, dtype="bfloat16", pages=True)
    bf16, fp8 = _pages(monkeypatch, **kw), _pages(monkeypatch, kv="fp8", **kw)
    assert bf16 > 1e9 and fp8 == pytest.approx(2 * bf16, abs=2)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2' is not supported"):
        _pages(monkeypatch, kv="fp8_e5m2", **kw)


def test_kv_cache_gets_the_share_less_weights_and_temporaries(monkeypatch):
    r = kv_memory.TEMP_RESERVE
    # An 80 GB device, the pool set from vLLM's default 0.9: a 61 GB MoE keeps 0.9 * 72 - 61 GB
    # of KV (in JAX's default pool of 60 GB it did not even load).
    got = _pages(monkeypatch, fraction=0.9, limit=72 * GB, in_use=61 * GB, own=61 * GB, util=0.9)
    assert got == pytest.approx((1 - r) * 72 * GB - 61 * GB, abs=8)
    # JAX used before in the process (its default pool, 0.75 of 80 GB): the share within the pool.
    got = _pages(monkeypatch, fraction=0.75, limit=60 * GB, in_use=16 * GB, own=16 * GB, util=0.9)
    assert got == pytest.approx(60 * GB - r * 72 * GB - 16 * GB, abs=8)
    # Two engines of 0.45 in a pool of 0.9: the second's share counts its own weights only,
    # and the pool's free bytes (less its reserve) cap it.
    got = _pages(monkeypatch, fraction=0.9, limit=72 * GB, in_use=37 * GB, own=1 * GB, util=0.45)
    assert got == pytest.approx(72 * GB - r * 36 * GB - 37 * GB, abs=8)
    got = _pages(monkeypatch, fraction=0.9, limit=72 * GB, in_use=20 * GB, own=1 * GB, util=0.45)
    assert got == pytest.approx((1 - r) * 36 * GB - 1 * GB, abs=8)
    # No pool (the platform allocator): the limit jax reports is the device.
    got = _pages(monkeypatch, fraction=None, limit=80 * GB, in_use=16 * GB, own=16 * GB, util=0.5)
    assert got == pytest.approx((1 - r) * 40 * GB - 16 * GB, abs=8)
    # Nothing left: still one sequence's pages (create_pools then says whether they fit).
    assert _pages(monkeypatch, fraction=0.9, limit=72 * GB, in_use=71 * GB, own=70 * GB, util=0.9) == 8


def test_large_logits_reserve_their_temporaries(monkeypatch):
    """A step of many logit rows over a large vocabulary (DFlash K=15 at 256 rows: 4,096 rows of
    Qwen3's 151,936) leaves LOGIT_COPIES f32 [rows, V] arrays to XLA's temporaries, not 10%;
    a small one (EAGLE3 K=3 at 8 rows) the 10% as before."""
    kw = dict(fraction=0.9, limit=126 * GB, in_use=17 * GB, own=17 * GB, util=0.9)
    share = 126 * GB
    big = kv_memory.LOGIT_COPIES * 4096 * 151936 * 4
    assert big > kv_memory.TEMP_RESERVE * share
    got = _pages(monkeypatch, logit_rows=4096, vocab=151936, **kw)
    assert got == pytest.approx(share - big - 17 * GB, abs=8)
    got = _pages(monkeypatch, logit_rows=32, vocab=128256, **kw)
    assert got == pytest.approx((1 - kv_memory.TEMP_RESERVE) * share - 17 * GB, abs=8)
