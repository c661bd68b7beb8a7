"""Rejection sampler: exact cases, top-k/top-p sets, kernel == reference with poisoned outputs.

Runs on CPU: "interpret" is the GPU kernel body under interpret=True, "tpu_interpret" the
TPU kernel under pltpu.InterpretParams().
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import rejection_sampling as rs
from kernels_pallas import sampling_utils as su
from kernels_pallas.rejection_sampling import ref_rejection_sample, rejection_sample

IMPLS = ["reference", "interpret", "tpu_interpret"]
V = 160  # two vocabulary blocks of 128 (rs.sample_block): exercises the ragged last block
BPP = 4  # GPU blocks per program: one program covers both blocks plus two empty grid-padding ones


def _kernels(impl, bpp=None):
    """The block kernels a test's impl name stands for, run on this CPU."""
    if impl == "tpu_interpret":
        return rs.tpu_kernels(interpret=True)
    assert impl == "interpret", impl
    return rs.gpu_kernels(interpret=True, blocks_per_program=bpp)


def _call(impl, logits, drafts, nd, probs, temp, top_k=None, top_p=None, seeds=None, pos=None, **kw):
    b = logits.shape[0]
    top_k = jnp.zeros((b,), jnp.int32) if top_k is None else jnp.asarray(top_k, jnp.int32)
    top_p = jnp.ones((b,), jnp.float32) if top_p is None else jnp.asarray(top_p, jnp.float32)
    seeds = jnp.arange(b, dtype=jnp.uint32) * 7 + 1 if seeds is None else seeds
    pos = jnp.full((b,), 11, jnp.int32) if pos is None else pos
    args = (jnp.asarray(logits), jnp.asarray(drafts, jnp.int32), jnp.asarray(nd, jnp.int32), probs,
            jnp.asarray(temp, jnp.float32), top_k, top_p, seeds, pos)
    if impl == "reference":
        out = ref_rejection_sample(*args, **kw)
    else:
        out = rejection_sample(*args, kernels=_kernels(impl, BPP), **kw)
    return np.asarray(out[0]), np.asarray(out[1])


def _peaked(targets, v=V):
    """Logits [B, K+1, V] whose distribution is (numerically) one-hot at targets [B, K+1]."""
    return 100.0 * jax.nn.one_hot(jnp.asarray(targets), v, dtype=jnp.float32)


def _onehot_q(drafts, v=V):
    return jax.nn.one_hot(jnp.asarray(drafts), v, dtype=jnp.float32)


# Requests (K = 3): perfect match, early mismatch at draft 2, fewer drafts (1, 0).
DRAFTS = [[5, 6, 7], [5, 6, 7], [9, 1, 1], [3, 3, 3]]
TARGETS = [[5, 6, 7, 8], [5, 40, 7, 8], [9, 2, 2, 2], [12, 0, 0, 0]]
NUM_DRAFT = [3, 3, 1, 0]
WANT = [[5, 6, 7, 8], [5, 40, -1, -1], [9, 2, -1, -1], [12, -1, -1, -1]]
WANT_N = [4, 2, 2, 1]


@pytest.mark.parametrize("impl, q_kind", [
    ("reference", "none"), ("reference", "dense"), ("interpret", "none"), ("interpret", "onehot"),
    ("interpret", "dense"), ("tpu_interpret", "dense"),  # TPU interpret is slow: one case
])
def test_exact_cases_mixed_batch(impl, q_kind):
    # The same four requests twice: greedy copies and sampled copies in one batch.
    drafts = np.array(DRAFTS * 2)
    logits = _peaked(np.array(TARGETS * 2))
    temp = [0.0] * 4 + [0.8] * 4
    probs = None
    if q_kind == "onehot":
        probs = _onehot_q(drafts)
    elif q_kind == "dense":
        # q(d) = 0.5: the target (one-hot at d) still accepts surely: p/q = 2 >= u.
        probs = 0.5 * _onehot_q(drafts) + 0.5 / V
    tokens, n = _call(impl, logits, drafts, NUM_DRAFT * 2, probs, temp)
    np.testing.assert_array_equal(tokens, np.array(WANT * 2))
    np.testing.assert_array_equal(n, np.array(WANT_N * 2))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rates, want, want_n", [
    ((1.0, 1.0), [[1, 2, 30], [1, 2, 30], [1, 20, -1]], [3, 3, 2]),
    ((0.0, 0.0), [[10, -1, -1], [10, -1, -1], [10, -1, -1]], [1, 1, 1]),
])
def test_synthetic_all_accept_all_reject(impl, rates, want, want_n):
    # The target disagrees with every draft: only the forced decisions accept.
    drafts = np.array([[1, 2], [1, 2], [1, 2]] * 2)
    nd = [2, 2, 1] * 2
    logits = _peaked(np.array([[10, 20, 30]] * 6))
    temp = [0.0] * 3 + [1.0] * 3
    tokens, n = _call(impl, logits, drafts, nd, None, temp, method="synthetic", synthetic_rates=rates)
    np.testing.assert_array_equal(tokens, np.array(want * 2))
    np.testing.assert_array_equal(n, np.array(want_n * 2))


@pytest.mark.parametrize("impl", IMPLS)
def test_k0_greedy_ties_and_sampling(impl):
    logits = np.zeros((4, 1, V), np.float32)
    logits[0, 0, [7, 3, 90]] = 2.0  # tie: lowest index (3) like jnp.argmax
    logits[1, 0, :] = 1.0  # all tied -> 0
    logits[2, 0, 50] = 100.0
    logits[3, 0, 50] = 100.0
    tokens, n = _call(impl, logits, np.zeros((4, 0)), [0] * 4, None, [0.0, 0.0, 0.0, 1.0])
    np.testing.assert_array_equal(tokens[:, 0], [3, 0, 50, 50])
    np.testing.assert_array_equal(n, [1, 1, 1, 1])
    # All greedy takes the argmax fast path: still exact.
    tokens, _ = _call(impl, logits, np.zeros((4, 0)), [0] * 4, None, [0.0] * 4)
    np.testing.assert_array_equal(tokens[:, 0], np.argmax(logits[:, 0], -1))


def _allowed_numpy(logits, temp, top_k, top_p):
    """Independent numpy top-k/top-p allowed sets (ties at the cut-off kept)."""
    x = np.asarray(logits, np.float64)
    s = -np.sort(-x)
    keep = np.ones_like(x, bool)
    if 0 < top_k < x.size:
        keep &= x >= s[top_k - 1]
    if top_p < 1.0:
        z = np.where(keep, x / temp, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        ps = -np.sort(-p)
        excl = np.cumsum(ps) - ps
        n_keep = max(int(np.sum(excl < top_p)), 1)
        keep &= p >= ps[n_keep - 1] * (1 - 1e-6)
    return keep


def _random_batch(rng, b, k, v, dtype=jnp.float32, with_probs=False):
    logits = jnp.asarray(rng.normal(size=(b, k + 1, v)) * 2.0, dtype)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, k, v)) * 2.0, jnp.float32), -1)
    # Drafts: often the target's favourite (so some get accepted), sometimes random.
    fav = np.asarray(jnp.argmax(logits[:, :k].astype(jnp.float32), -1))
    drafts = np.where(rng.random((b, k)) < 0.7, fav, rng.integers(0, v, (b, k)))
    nd = rng.integers(0, k + 1, b)
    temp = np.where(rng.random(b) < 0.3, 0.0, rng.uniform(0.3, 1.5, b)).astype(np.float32)
    top_k = np.where(rng.random(b) < 0.4, rng.integers(1, 30, b), 0)
    top_p = np.where(rng.random(b) < 0.4, rng.uniform(0.2, 0.95, b), 1.0).astype(np.float32)
    seeds = jnp.asarray(rng.integers(0, 2**32, b, dtype=np.uint64).astype(np.uint32))
    pos = jnp.asarray(rng.integers(0, 4000, b), jnp.int32)
    return (logits, jnp.asarray(drafts, jnp.int32), jnp.asarray(nd, jnp.int32),
            q if with_probs else None, jnp.asarray(temp), jnp.asarray(top_k, jnp.int32),
            jnp.asarray(top_p), seeds, pos)


@pytest.mark.parametrize("impl", ["interpret"])
def test_topk_topp_emitted_tokens_allowed(impl):
    rng = np.random.default_rng(3)
    b, k, v = 24, 3, V
    args = list(_random_batch(rng, b, k, v))
    args[4] = jnp.asarray(rng.uniform(0.5, 1.5, b), jnp.float32)  # all sampled
    args[5] = jnp.asarray(rng.integers(1, 12, b), jnp.int32)
    args[6] = jnp.asarray(rng.uniform(0.2, 0.9, b), jnp.float32)
    tokens, n = rejection_sample(*args, kernels=_kernels(impl, BPP))
    tokens, n = np.asarray(tokens), np.asarray(n)
    probs = np.asarray(su.target_probs(args[0], args[4], args[5], args[6]))
    for bi in range(b):
        for j in range(n[bi]):
            allowed = _allowed_numpy(np.asarray(args[0][bi, j]), float(args[4][bi]),
                                     int(args[5][bi]), float(args[6][bi]))
            np.testing.assert_array_equal(probs[bi, j] > 0, allowed)
            assert allowed[tokens[bi, j]], (bi, j, tokens[bi, j])
        assert np.all(tokens[bi, n[bi]:] == -1)


@pytest.mark.parametrize("k, dtype, with_probs", [
    (0, jnp.float32, False), (3, jnp.float32, True), (3, jnp.bfloat16, False), (1, jnp.bfloat16, True),
])
def test_kernel_block_stats_match_reference_poisoned(k, dtype, with_probs):
    rng = np.random.default_rng(10 * k + with_probs)
    b, v = 13, 300  # blocks of 256: one full, one ragged
    logits, drafts, nd, q, temp, top_k, top_p, seeds, pos = _random_batch(rng, b, k, v, dtype, with_probs)
    d, mode, key, inv_t, thr = jax.jit(rs._row_params)(logits, drafts, nd, temp, top_k, top_p, seeds, pos)
    want = jax.jit(rs._ref_block_stats)(logits, d, mode, inv_t, thr)
    # Outputs are aliased to buffers pre-filled with -7 / NaN: any slot the kernel does not
    # write (padding rows included) would show up.
    got = {
        f"gpu_bpp{p}": jax.jit(lambda *a, p=p: rs._stats_gpu(*a, interpret=True, bpp=p, poison=True))(
            logits, d, mode, inv_t, thr)
        for p in (1, 4)  # blocks per program (4: a loop, over two grid-padding blocks too)
    } | {
        "tpu": jax.jit(lambda *a: rs._stats_tpu(*a, interpret=True, poison=True))(logits, d, mode, inv_t, thr),
    }
    assert want[0].shape == (b, k + 1, rs.num_blocks(v)) == (b, k + 1, 2)
    for name, stats in got.items():
        for w, g in zip(want, stats):
            assert g.shape == w.shape, name
            assert not np.any(np.isnan(np.asarray(g, np.float32))), name  # every slot written
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=1e-30, err_msg=name)
        np.testing.assert_array_equal(np.asarray(stats[3]), np.asarray(want[3]))  # argmax columns
    if with_probs:
        m = jnp.max(want[0], -1)[:, :k]
        s = jnp.sum(want[1] * jnp.exp(want[0] - jnp.max(want[0], -1, keepdims=True)), -1)[:, :k]
        rw = rs._ref_block_resid(logits[:, :k], q, mode[:, :k], inv_t[:, :k], thr[:, :k], m, s)
        args = (logits, q, d[:, :k], mode[:, :k], inv_t[:, :k], thr[:, :k], m, s)
        for r in (rs._resid_gpu(*args, interpret=True, bpp=2, poison=True),
                  rs._resid_gpu(*args, interpret=True, poison=True),
                  rs._resid_tpu(*args, interpret=True, poison=True)):
            np.testing.assert_allclose(np.asarray(r), np.asarray(rw), rtol=2e-6, atol=1e-7)
            assert np.any(np.asarray(rw) > 0)
    assert np.all(np.asarray(jax.jit(rs._ref_rows)(logits, q, d, mode, key, inv_t, thr)[0])[np.asarray(mode) == rs._PAD] == -1)


@pytest.mark.parametrize("impl, method, with_probs", [
    ("interpret", "standard", False), ("interpret", "standard", True),
    ("interpret", "synthetic", False), ("interpret", "synthetic", True),
    ("tpu_interpret", "standard", True),
])
def test_kernel_matches_reference_end_to_end(impl, method, with_probs):
    rng = np.random.default_rng(7)
    k = 3
    args = _random_batch(rng, 40 if impl == "interpret" else 16, k, 300, jnp.float32, with_probs)
    kw = dict(method=method, synthetic_rates=(0.8, 0.5, 0.4) if method == "synthetic" else None)
    want = ref_rejection_sample(*args, **kw)
    got = jax.jit(lambda *a: rejection_sample(*a, kernels=_kernels(impl), **kw))(*args)  # under an outer jit
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    n = np.asarray(want[1])
    assert n.min() >= 1 and n.max() <= k + 1 and len(set(n.tolist())) > 1


def test_filtering_modes_agree():
    # "auto" decided on the host (numpy params), on the device (jax arrays: lax.cond), and
    # the explicit modes give the same tokens; "off" ignores top-k/top-p as documented.
    rng = np.random.default_rng(11)
    args = list(_random_batch(rng, 12, 2, V))
    host = args[:4] + [np.asarray(a) for a in args[4:7]] + args[7:]
    with_filters = [np.asarray(rejection_sample(*a, **kw)[0])
                    for a, kw in ((args, {}), (host, {}), (args, dict(filtering="on")))]
    np.testing.assert_array_equal(with_filters[0], with_filters[1])
    np.testing.assert_array_equal(with_filters[0], with_filters[2])
    plain = args[:5] + [jnp.zeros(12, jnp.int32), jnp.ones(12, jnp.float32)] + args[7:]
    no_filters = [np.asarray(rejection_sample(*plain, filtering=f)[0]) for f in ("auto", "off", "on")]
    np.testing.assert_array_equal(no_filters[0], no_filters[1])
    np.testing.assert_array_equal(no_filters[0], no_filters[2])
    # top_k = 1 at temperature 1.5: only "off" can emit anything but the row's argmax.
    k1 = args[:4] + [np.full(12, 1.5, np.float32), np.ones(12, np.int32), np.ones(12, np.float32)] + args[7:]
    k1[2] = jnp.zeros(12, jnp.int32)  # no drafts: one sampled token per request
    top1 = np.asarray(jnp.argmax(args[0][:, 0], -1))
    assert np.array_equal(np.asarray(rejection_sample(*k1)[0])[:, 0], top1)
    assert not np.array_equal(np.asarray(rejection_sample(*k1, filtering="off")[0])[:, 0], top1)
    with pytest.raises(ValueError, match="filtering"):
        rejection_sample(*args, filtering="maybe")


def test_seeded_request_independent_of_batch():
    rng = np.random.default_rng(5)
    args = _random_batch(rng, 16, 3, 300)
    full = rejection_sample(*args, kernels=_kernels("interpret"))
    sub = rejection_sample(*(a[3:5] if a is not None else None for a in args), kernels=_kernels("interpret"))
    np.testing.assert_array_equal(np.asarray(full[0])[3:5], np.asarray(sub[0]))


def test_uniform_range_and_sample_from_probs():
    u = su.uniform(jnp.uint32(2**32 - 1), jnp.arange(1000)[:, None], jnp.arange(1000)[None, :], su.SALT_RACE)
    u = np.asarray(u)
    assert u.min() > 0 and u.max() < 1 and abs(u.mean() - 0.5) < 2e-3
    probs = jnp.asarray([[0.0, 0.25, 0.75, 0.0]] * 4000)
    s = np.asarray(su.sample_from_probs(probs, jnp.arange(4000), jnp.zeros(4000, jnp.int32), su.SALT_DRAFT))
    assert set(s.tolist()) <= {1, 2} and abs(np.mean(s == 2) - 0.75) < 0.03


def test_validation_errors():
    b, k, v = 2, 2, 8
    good = dict(target_logits=jnp.zeros((b, k + 1, v)), draft_tokens=jnp.zeros((b, k), jnp.int32),
                num_draft=jnp.zeros((b,), jnp.int32), draft_probs=None,
                temperature=jnp.zeros((b,)), top_k=jnp.zeros((b,), jnp.int32), top_p=jnp.ones((b,)),
                seeds=jnp.zeros((b,), jnp.uint32), positions=jnp.zeros((b,), jnp.int32))
    for name, bad in [("draft_tokens", jnp.zeros((b, k + 1), jnp.int32)), ("num_draft", jnp.zeros((b + 1,), jnp.int32)),
                      ("draft_probs", jnp.zeros((b, k, v + 1))), ("temperature", jnp.zeros((b,), jnp.int32)),
                      ("target_logits", jnp.zeros((b, v)))]:
        with pytest.raises(ValueError, match=name):
            rejection_sample(**{**good, name: bad})
    with pytest.raises(ValueError, match="synthetic_rates"):
        rejection_sample(**good, method="synthetic")
    with pytest.raises(ValueError, match="blocks_per_program must be a power of two"):
        rs.gpu_kernels(blocks_per_program=3)
    with pytest.raises(ValueError, match="num_stages must be an int"):
        rs.gpu_kernels(num_stages=0)


def test_all_greedy_shortcut_equals_sampled_path(monkeypatch):
    """The jnp path (no kernels) answers an all-greedy batch by argmax (a lax.cond): the same
    tokens as the full path, which a batch with one sampled row takes. Ties resolve to the
    lowest index, as in the kernels. Off the CPU (tensor parallelism runs the reference on a
    GPU, where a conditional is a host sync) it has no conditional: the all-greedy batch
    takes the full path, with the same tokens."""
    rng = np.random.default_rng(7)
    B, K, V = 4, 3, 3000
    logits = rng.standard_normal((B, K + 1, V)).astype(np.float32)
    logits[0, 1, [5, 2900]] = 50.0  # a tie: the lowest index wins
    argmax = logits.argmax(-1)
    drafts = argmax[:, :K].copy()
    drafts[1, 1] = (drafts[1, 1] + 1) % V  # row 1 rejects at position 1
    num_draft = np.array([3, 3, 2, 0], np.int32)
    seeds, pos = np.arange(B, dtype=np.int32), np.full(B, 10, np.int32)
    common = dict(draft_tokens=drafts, num_draft=num_draft, draft_probs=None, top_k=np.zeros(B, np.int32),
                  top_p=np.ones(B, np.float32), seeds=seeds, positions=pos)
    toks, n = rejection_sample(logits, temperature=np.zeros(B, np.float32), **common)
    temp = np.zeros(B, np.float32)
    temp[3] = 0.7  # one sampled row sends the batch down the full path
    toks_full, n_full = rejection_sample(logits, temperature=temp, **common)
    np.testing.assert_array_equal(np.asarray(n)[:3], np.asarray(n_full)[:3])
    np.testing.assert_array_equal(np.asarray(toks)[:3], np.asarray(toks_full)[:3])
    np.testing.assert_array_equal(np.asarray(n), [4, 2, 3, 1])
    assert int(np.asarray(toks)[0, 1]) == 5 and int(np.asarray(toks)[1, 1]) == argmax[1, 1]
    monkeypatch.setattr(rs, "_conditionals_on_device", lambda: False)
    rs._rejection_sample_jit.clear_cache()  # traced again: the choice is made at trace time
    toks_gpu, n_gpu = rejection_sample(logits, temperature=np.zeros(B, np.float32), **common)
    rs._rejection_sample_jit.clear_cache()
    np.testing.assert_array_equal(np.asarray(toks_gpu), np.asarray(toks))
    np.testing.assert_array_equal(np.asarray(n_gpu), np.asarray(n))
