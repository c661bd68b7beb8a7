"""Tensor parallelism below the engine: the sharded forward against the unsharded one (a
tied lm_head: the vocabulary-sharded table), each device's parameter bytes, the per-device
read of a fused leaf, and the errors of configurations that do not split (a vocabulary
always does: test_tp_vocab.py)."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import parallel
from jspec.checkpoint.target import load_target, target_param_spec
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.transformer import Transformer
from jspec.ops import plan_kernels, plan_params
from tests.helpers import parallel as h


def _forward(folder, tp, load_format="auto"):
    mesh = parallel.make_mesh(tp)
    cfg, params = load_target(folder, "float32", sharding=parallel.Placement(mesh, tp) if mesh else None,
                              load_format=load_format)
    plan = plan_kernels(cfg, tp=tp, mesh=mesh)
    params = plan_params(plan, params)
    kv = KVCache.create(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, jnp.float32,
                        parallel.kv_sharding(mesh, cfg.num_kv_heads, tp))
    meta = AttentionMetadata.for_single_sequence([2, 0], 16, 0, 20, 4)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (1, 20)), jnp.int32)
    model = Transformer(cfg, plan=plan)

    @jax.jit
    def run(params, kv):
        h, _, _ = model.apply({"params": params}, tokens, meta, kv)
        return model.apply({"params": params}, h, method=Transformer.logits)

    return cfg, params, np.asarray(run(params, kv))


def test_tied_forward_and_bytes_at_tp4(llama_ckpt):
    folder, _ = llama_ckpt  # tests/helpers/targets.py "llama_tied": 4 heads, 2 KV heads, tied lm_head
    cfg, _, want = _forward(folder, 1)
    assert cfg.tie_word_embeddings
    _, params, got = _forward(folder, 4)
    # Same maths, per-device partial sums added in another order: float32 rounding only.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()
    per_device = parallel.device_param_bytes(params)
    total = sum(np.prod(s.shape) * 4 for s in target_param_spec(cfg))
    assert len(per_device) == 4
    for dev, n in per_device.items():
        assert abs(n - total / 4) <= 0.1 * total / 4, (dev, n, total)
    emb = params["embed_tokens"]["embedding"]  # the table (and tied lm_head) by vocabulary
    assert {s.data.shape for s in emb.addressable_shards} == {(cfg.vocab_size // 4, cfg.hidden_size)}


def test_engine_bytes_per_device():
    """The tp-4 EAGLE3 engine of the greedy tests: target and drafter each within 10% of
    total / 4 on every device (embeddings, lm_heads and the replicated norms included)."""
    eng = h.llm("llama", "eagle3", 4).engine
    for tree in (eng.runner.params, eng.runner.dparams):
        total = sum(x.nbytes for x in jax.tree.leaves(tree))
        per_device = parallel.device_param_bytes(tree)
        assert len(per_device) == 4
        assert all(abs(n - total / 4) <= 0.1 * total / 4 for n in per_device.values()), (per_device, total)


def test_fused_leaf_read_per_device():
    """Device i holds [q_i | k_i | v_i]: slice i of each projection (tp-interleaved), read
    from the safetensors file slice by slice."""
    folder, hf = h.target("qwen3")
    mesh = parallel.make_mesh(2)
    cfg, params = load_target(folder, "float32", sharding=parallel.Placement(mesh, 2))
    w = params["layers_0"]["attn"]["qkv_proj"]["weight"]
    attn = hf.model.layers[0].self_attn
    q, k, v = (p.weight.detach().numpy() for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    for shard in w.addressable_shards:
        i = shard.index[0].start // (w.shape[0] // 2)
        want = np.concatenate([x[i * len(x) // 2: (i + 1) * len(x) // 2] for x in (q, k, v)])
        np.testing.assert_array_equal(np.asarray(shard.data), want)


def _config_folder(tmp_path, src, **changes):
    folder = tmp_path / "_".join(f"{k}{v}" for k, v in changes.items())
    folder.mkdir()
    shutil.copy(os.path.join(src, "config.json"), folder)
    with open(folder / "config.json") as f:
        d = json.load(f)
    d.update(changes)
    with open(folder / "config.json", "w") as f:
        json.dump(d, f)
    return str(folder)


def test_errors_name_the_numbers(tmp_path):
    folder, _ = h.target("llama")  # 8 heads of 8, 2 KV heads, intermediate 96, vocab 64
    bad = [({"num_attention_heads": 6, "head_dim": 8}, 4, r"num_attention_heads=6"),
           ({"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8}, 2, r"num_key_value_heads=3"),
           ({"intermediate_size": 90}, 4, r"intermediate_size=90")]  # any vocabulary splits: test_tp_vocab.py
    for changes, tp, match in bad:
        with pytest.raises(ValueError, match=f"tensor_parallel_size={tp} .*{match}|{match}"):
            jspec.LLM(_config_folder(tmp_path, folder, **changes), load_format="dummy", tensor_parallel_size=tp)
    with pytest.raises(ValueError, match="tensor_parallel_size=16 asks for more devices than exist: jax sees 8"):
        jspec.LLM(folder, tensor_parallel_size=16)
    sc = h.spec_config("llama", "eagle3")
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=8 does not divide the drafter's "
                                         "num_attention_heads=4"):
        jspec.LLM(folder, tensor_parallel_size=8, speculative_config=sc, **h.ENGINE_KW)
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size=2 must be 1 .* or tensor_parallel_size=4"):
        jspec.LLM(folder, tensor_parallel_size=4, speculative_config={**sc, "draft_tensor_parallel_size": 2},
                  **h.ENGINE_KW)


def test_attention_kernel_per_shard():
    """The paged-attention kernel under tp (ops.attention): once per device under shard_map
    over the KV heads (tp 2 divides 2 KV heads; the GPU kernel in Pallas' interpreter), and
    the XLA path where the KV heads are replicated (tp 4): both equal the reference."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jspec import ops

    rng = np.random.default_rng(0)
    B, Q, H, KVH, D = 2, 3, 4, 2, 16
    q = jnp.asarray(rng.standard_normal((B, Q, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((6, 8, KVH, D)), jnp.float32) for _ in range(2))
    meta = AttentionMetadata(jnp.asarray([[1, 3], [0, 5]], jnp.int32), jnp.asarray([12, 9], jnp.int32),
                             jnp.asarray([[9, 10, 11], [6, 7, 8]], jnp.int32), jnp.zeros((B, Q), jnp.int32),
                             jnp.ones((B,), bool))
    want = ops.attention(ops.KernelPlan(), q, k, v, meta, sm_scale=D**-0.5)
    for tp in (2, 4):
        mesh = parallel.make_mesh(tp)
        heads = NamedSharding(mesh, P(None, None, "tp", None))
        plan = ops.KernelPlan(attn=ops.GPU(interpret=True), tp=tp, mesh=mesh)
        kv_sharding = parallel.kv_sharding(mesh, KVH, tp)
        got = jax.jit(lambda q, k, v, plan=plan: ops.attention(plan, q, k, v, meta, sm_scale=D**-0.5))(
            jax.device_put(q, heads), jax.device_put(k, kv_sharding), jax.device_put(v, kv_sharding))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


def test_orbax_and_dummy_under_tp(tmp_path):
    """An orbax copy restores sharded, its fused leaves interleaved on the devices: the same
    arrays (values and shardings) as the per-device safetensors read; load_format="dummy"
    places every leaf on its split too."""
    from jspec.checkpoint.target import flat_params, save_orbax

    folder, _ = h.target("qwen3")
    place = parallel.Placement(parallel.make_mesh(4), 4)
    _, want = load_target(folder, "float32", sharding=place)
    copy = tmp_path / "orbax_copy"
    copy.mkdir()
    shutil.copy(os.path.join(folder, "config.json"), copy)
    save_orbax(load_target(folder, "float32")[1], str(copy))
    _, got = load_target(str(copy), "float32", sharding=place)
    _, dummy = load_target(folder, "float32", sharding=place, load_format="dummy")
    a, b, d = flat_params(want), flat_params(got), flat_params(dummy)
    assert a.keys() == b.keys() == d.keys()
    for k in a:
        assert b[k].sharding.is_equivalent_to(a[k].sharding, a[k].ndim), k
        assert d[k].sharding.is_equivalent_to(a[k].sharding, a[k].ndim), k
        np.testing.assert_array_equal(np.asarray(b[k]), np.asarray(a[k]), err_msg=k)


def test_dummy_weights_are_one_model_at_every_tp():
    """load_format="dummy" draws the same model at every tensor-parallel size (its fused
    q|k|v and gate|up rows put in the tp-interleaved layout), so scripts/bench_tp.py can
    compare greedy outputs across sizes on random 8B / 70B shapes."""
    folder, _ = h.target("qwen3")
    _, _, want = _forward(folder, 1, "dummy")
    _, _, got = _forward(folder, 4, "dummy")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_server_flag():
    from jspec.serve.cli import build_parser, engine_kwargs

    assert engine_kwargs(build_parser().parse_args(["--tensor-parallel-size", "4"]))["tensor_parallel_size"] == 4
    assert engine_kwargs(build_parser().parse_args(["-tp", "2"]))["tensor_parallel_size"] == 2
    assert engine_kwargs(build_parser().parse_args([]))["tensor_parallel_size"] == 1
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1, got 0"):
        jspec.LLM(h.target("llama")[0], tensor_parallel_size=0)


def test_layer_per_shard_runs_the_glue_kernels(tmp_path, monkeypatch):
    """A decoder layer under tp 2 (2 KV heads) runs once per device (ops.per_shard_layer)
    with tp 1's batch-1 kernels on each device's weights (Pallas' interpreter here) and an
    all-reduce after o_proj and down_proj: a prefill and a decode step give tp 1's logits,
    and the decode step traced the qkv / fused-linear kernels on the local shapes."""
    from jspec import ops
    from kernels_pallas import fused_linear as fl
    from kernels_pallas import qkv_rope_kv_write as qkv

    # 8 heads of 16 (the attention kernel's smallest), 2 KV heads; intermediate 128: gate|up
    # and down shards the kernel's power-of-two tiles divide
    folder = _config_folder(tmp_path, h.target("llama")[0], head_dim=16, intermediate_size=128)
    seen = []
    for mod, name in ((fl, "fused_linear_gpu"), (qkv, "qkv_rope_kv_write_gpu")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **kw: seen.append(
            (_name, kw.get("prologue"), a[1].shape)) or _real(*a, **kw))
    tokens = np.random.default_rng(1).integers(3, 384, (1, 21))

    def run(tp):
        mesh = parallel.make_mesh(tp)
        cfg, params = load_target(folder, "float32", sharding=parallel.Placement(mesh, tp) if mesh else None,
                                  load_format="dummy")
        plan = ops.KernelPlan(tp=tp, mesh=mesh, shard_linear=ops.GPU(interpret=True),
                              attn=ops.GPU(interpret=True) if tp > 1 else ops.XLA())
        assert ops.layer_per_shard(plan, cfg.num_kv_heads) == (tp > 1)
        kv = KVCache.create(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, jnp.float32,
                            parallel.kv_sharding(mesh, cfg.num_kv_heads, tp))
        model = Transformer(cfg, plan=plan)

        @jax.jit
        def step(params, kv, toks, meta):
            hs, _, kv = model.apply({"params": params}, toks, meta, kv)
            return model.apply({"params": params}, hs, method=Transformer.logits), kv

        prefill, kv = step(params, kv, jnp.asarray(tokens[:, :20], jnp.int32),
                           AttentionMetadata.for_single_sequence([2, 0], 16, 0, 20, 4))
        decode, _ = step(params, kv, jnp.asarray(tokens[:, 20:], jnp.int32),
                         AttentionMetadata.for_single_sequence([2, 0], 16, 20, 1, 4))
        return np.asarray(prefill), np.asarray(decode)

    want = run(1)
    assert not seen  # tp 1 here: the reference plan
    got = run(2)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4 * np.abs(w).max())
    # per device at the decode step: [q|k|v] of 4 heads + 1 KV head (16 wide), gate|up 2 x 64
    # rows, down 64 rows (no residual: the partial sums are all-reduced first), o_proj's
    # partial sums over its 4 heads (ops.partial_linear)
    assert ("qkv_rope_kv_write_gpu", None, (96, 64)) in seen
    assert ("fused_linear_gpu", "none", (64, 64)) in seen
    assert ("fused_linear_gpu", "rmsnorm", (128, 64)) in seen
    assert ("fused_linear_gpu", "silu_mul", (64, 64)) in seen
