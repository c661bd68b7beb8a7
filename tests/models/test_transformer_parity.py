"""Issue 2: jspec's Flax target == transformers' PyTorch model (float32, CPU)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from jspec.checkpoint.target import load_target
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.transformer import Transformer
from tests.helpers.targets import hf_checkpoint, hf_greedy

PROMPT_LEN, DECODE_STEPS, PAGE = 40, 8, 8


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_prefill_decode_and_hidden_states_match_transformers(target):
    kind, folder, hf = target
    cfg, params = load_target(folder, "float32")
    L = cfg.num_layers
    model = Transformer(cfg)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, cfg.vocab_size, size=PROMPT_LEN + DECODE_STEPS)
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None]), output_hidden_states=True)
    ref_logits = ref.logits[0].numpy()
    # A scrambled page order: the paged path must not depend on pages being contiguous.
    num_pages = 16
    pages = list(np.random.default_rng(2).permutation(num_pages))
    kv = KVCache.create(L, num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    aux_ids = tuple(range(L))  # canonical c < L: HF's hidden_states[c]
    meta = AttentionMetadata.for_single_sequence(pages, PAGE, 0, PROMPT_LEN, num_pages)
    h, aux, kv = model.apply({"params": params}, jnp.asarray(ids[None, :PROMPT_LEN]), meta, kv, aux_layers=aux_ids)
    logits = model.apply({"params": params}, h, method=Transformer.logits)[0]
    assert rel(logits, ref_logits[:PROMPT_LEN]) < 1e-4
    for j, c in enumerate(aux_ids):
        assert rel(aux[0, :, j], ref.hidden_states[c][0, :PROMPT_LEN].numpy()) < 1e-4, f"canonical {c}"
    for step in range(DECODE_STEPS):
        pos = PROMPT_LEN + step
        meta = AttentionMetadata.for_single_sequence(pages, PAGE, pos, 1, num_pages)
        h, aux, kv = model.apply({"params": params}, jnp.asarray(ids[None, pos : pos + 1]), meta, kv, aux_layers=(0, L - 1))
        logits = model.apply({"params": params}, h, method=Transformer.logits)[0, 0]
        assert rel(logits, ref_logits[pos]) < 1e-4, f"decode step {step}"
        assert rel(aux[0, 0, 1], ref.hidden_states[L - 1][0, pos].numpy()) < 1e-4


def test_greedy_generate_matches_transformers(target):
    import jspec

    kind, folder, hf = target
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 384, size=n)] for n in (5, 33)]
    llm = jspec.LLM(folder, max_num_seqs=2, max_model_len=128, page_size=8)
    outs = llm.generate(prompts, jspec.SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, p, 32), kind


def test_unsupported_head_dim_falls_back_to_xla(ckpt_root, caplog):
    """Qwen3's tiny head_dim 24 fits neither the GPU kernels' power-of-2 tiles nor the TPU
    kernel's 128 lanes: with the kernels asked for (GPU kernel bodies in Pallas'
    interpreter, as on a GPU) the engine runs the XLA path with one log line, and greedy
    output still equals transformers'."""
    import logging

    import jspec

    folder, hf = hf_checkpoint(ckpt_root, "qwen3")
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 384, size=12)]
    with caplog.at_level(logging.WARNING, logger="jspec.kernels"):
        llm = jspec.LLM(folder, max_num_seqs=1, max_model_len=64, page_size=8, attn_impl="interpret",
                        linear_impl="interpret")
        out = llm.generate([prompt], jspec.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 8)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("paged_attention: head_dim 24 is not a power of 2" in m for m in msgs), msgs
    assert any("rope_kv_write: head_dim 24 is not twice a power of 2" in m for m in msgs), msgs


def test_moe_target_on_the_gpu_kernels_matches_transformers(ckpt_root, monkeypatch):
    """The Qwen3-MoE target with the GPU plan's kernels (their bodies in Pallas' interpreter,
    as on a GPU): two prompts decoding together route 2 x 2 pairs a layer, E / 2 of the 8
    experts, so ops.moe takes kernels_pallas/moe_experts.py's kernels; the prompts' prefill
    takes the dense pass. Greedy output still equals transformers'."""
    import jspec
    from kernels_pallas import moe_experts

    traced, real = [], moe_experts.moe_experts_gpu

    def recording(x, *a, **k):  # the token rows of each traced call
        traced.append(x.shape)
        return real(x, *a, **k)

    monkeypatch.setattr(moe_experts, "moe_experts_gpu", recording)
    folder, hf = hf_checkpoint(ckpt_root, "qwen3_moe")
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(3, 384, size=n)] for n in (7, 12)]
    llm = jspec.LLM(folder, max_num_seqs=2, max_model_len=64, page_size=8, attn_impl="interpret",
                    linear_impl="interpret")
    outs = llm.generate(prompts, jspec.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
    assert (2, hf.config.hidden_size) in traced, traced  # the batch-2 decode step's tokens went through the kernels
