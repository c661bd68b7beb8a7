"""ops.moe == transformers' Qwen3MoeSparseMoeBlock (float32) on each of its ways: the gather
(at most E token-expert pairs), one dense pass, and dense passes over chunks with a padded
last chunk. The whole model through the engine: tests/e2e/test_moe_target.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jspec import ops

E, K, H, I = 8, 2, 32, 24


@pytest.fixture(scope="module")
def block():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                         norm_topk_prob=True)
    torch.manual_seed(0)
    m = Qwen3MoeSparseMoeBlock(cfg).float()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


@pytest.mark.parametrize("n,chunk", [(1, 256), (4, 256), (5, 256), (40, 256), (37, 8), (16, 8)],
                         ids=["gather-1", "gather-4", "dense-5", "dense-40", "chunks-37-of-8", "chunks-16-of-8"])
@pytest.mark.parametrize("norm", [True, False])
def test_moe_matches_transformers(block, n, chunk, norm):
    block.gate.norm_topk_prob = norm
    x = torch.randn(1, n, H, generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        want = block(x).numpy()[0]
    got = ops.moe(ops.KernelPlan(), x.numpy()[0], block.gate.weight.detach().numpy(),
                  block.experts.gate_up_proj.detach().numpy(), block.experts.down_proj.detach().numpy(),
                  top_k=K, norm_topk_prob=norm, chunk=chunk)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_moe_adds_the_residual(block):
    x = np.random.default_rng(1).standard_normal((2, 12, H)).astype(np.float32)  # 24 pairs > E: dense
    r = np.random.default_rng(2).standard_normal((2, 12, H)).astype(np.float32)
    w = (block.gate.weight.detach().numpy(), block.experts.gate_up_proj.detach().numpy(),
         block.experts.down_proj.detach().numpy())
    plan = ops.KernelPlan()
    out = ops.moe(plan, x, *w, top_k=K, norm_topk_prob=True, chunk=8, residual=r)
    np.testing.assert_allclose(np.asarray(out), r + np.asarray(ops.moe(plan, x, *w, top_k=K, norm_topk_prob=True)),
                               rtol=1e-5, atol=1e-5)
