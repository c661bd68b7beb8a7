"""gpt-oss targets (issue 61) through jspec.LLM: the 20b and 120b shapes, random weights with
the experts in MXFP4 (load_format="dummy": folders holding only config.json, as gpt-oss
ships it), plain decode against the bytes one token streams, and EAGLE3 with synthetic
acceptance against its physical ideal.

    PYTHONPATH=.:scripts python3 scripts/bench_gpt_oss.py --shape 20b --batches 1,8,32 --json out.json
    PYTHONPATH=.:scripts python3 scripts/bench_gpt_oss.py --shape tiny    # a CPU smoke run

Bounds, each beside its figure, from the bandwidth probe of the same run:
  - plain batch 1: the bytes of one token (``token_bytes``): every attention, norm and sink
    weight, the routers, top_k experts a layer (packed: 4.25 bits a weight, their biases), the
    lm_head and one embedding row, over the probe's bandwidth;
  - EAGLE3 (K drafts, synthetic mean acceptance tau): tau * T(1) / (T(1) * V + K * drafter
    bytes / bandwidth), V the bytes of verifying K + 1 tokens over one token's: the experts
    those tokens touch, E (1 - (1 - k / E)^(K + 1)) a layer for a router that picks uniformly
    (random weights), and the same non-expert weights. The chain of K drafter forwards each
    streams its layer and head (../shared/reference/performance.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile

import numpy as np
from bench_common import llm_engine_kwargs, llm_run, measure_bandwidth, weight_bytes

# config.json of openai/gpt-oss-20b and -120b (their published keys; no weights are read)
GPT_OSS = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
    num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088, experts_per_token=4,
    num_experts_per_tok=4, sliding_window=128, rope_theta=150000.0, max_position_embeddings=131072,
    initial_context_length=4096, rms_norm_eps=1e-5, swiglu_limit=7.0, attention_bias=True,
    tie_word_embeddings=False, hidden_act="silu", torch_dtype="bfloat16", eos_token_id=200002,
    pad_token_id=199999, router_aux_loss_coef=0.9, output_router_logits=False, attention_dropout=0.0,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096},
    quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
)
SHAPES = {"20b": dict(num_hidden_layers=24, num_local_experts=32),
          "120b": dict(num_hidden_layers=36, num_local_experts=128),
          "tiny": dict(num_hidden_layers=4, num_local_experts=8, hidden_size=128, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512, sliding_window=8,
                       max_position_embeddings=4096)}


def target_json(shape: str) -> dict:
    d = {**GPT_OSS, **SHAPES[shape]}
    d["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(d["num_hidden_layers"])]
    return d


def drafter_json(t: dict, K: int, tiny: bool) -> dict:
    """A speculators-format EAGLE3 head for the target ``t``: one Llama layer of its width, a
    32K draft vocabulary (256 tiny), its auxiliary layers 2, L / 2 and L - 3."""
    L = t["num_hidden_layers"]
    layer = dict(model_type="llama", vocab_size=t["vocab_size"], hidden_size=t["hidden_size"],
                 intermediate_size=4 * t["hidden_size"], num_hidden_layers=1,
                 num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"],
                 head_dim=t["head_dim"], hidden_act="silu", rms_norm_eps=1e-5, rope_theta=t["rope_theta"],
                 max_position_embeddings=t["max_position_embeddings"], tie_word_embeddings=False,
                 attention_bias=False, mlp_bias=False)
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": K}],
                                   "verifier": {"name_or_path": None, "architectures": ["GptOssForCausalLM"]}},
            "transformer_layer_config": layer, "draft_vocab_size": 256 if tiny else 32000,
            "target_hidden_size": t["hidden_size"], "norm_before_fc": False, "norm_before_residual": True,
            "eagle_aux_hidden_state_layer_ids": [2, L // 2, L - 3], "torch_dtype": "bfloat16"}


def write(folder: str, d: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(d, f, indent=1)
    return folder


def expert_split(params) -> tuple[int, int, int]:
    """(bytes of the experts of one layer as loaded, of everything else streamed per token,
    layers): the experts' blocks, scales and biases against the rest (weight_bytes: no
    embedding table, which is gathered)."""
    import jax

    from jspec.mxfp4 import Mxfp4Weight

    per_layer, layers = [], 0
    for name, layer in params.items():
        if not isinstance(layer, dict) or "mlp" not in layer:
            continue
        layers += 1
        mlp = layer["mlp"]
        leaves = [mlp[k] for k in ("gate_up", "down", "gate_up_bias", "down_bias") if k in mlp]
        assert isinstance(mlp["gate_up"], Mxfp4Weight), f"{name}: experts not packed"
        per_layer.append(sum(a.nbytes for a in jax.tree.leaves(leaves)))
    total = weight_bytes(params)
    return per_layer[0], total - sum(per_layer), layers


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="20b")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--K", type=int, default=3)
    ap.add_argument("--taus", default="3.0", help="synthetic mean acceptance lengths of the EAGLE3 rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import jax.numpy as jnp

    import jspec
    from kernels_pallas.synthetic import conditional_rates, synthetic_rates_from_length

    tiny = args.shape == "tiny"
    ctx, new = (32, 16) if tiny else (args.ctx, args.new)
    batches = [int(b) for b in args.batches.split(",")]
    bw = measure_bandwidth(tiny)
    Bps = bw["best_TBps"] * 1e12
    root = tempfile.mkdtemp(prefix="jspec_bench_gpt_oss_")
    t = target_json(args.shape)
    tdir = write(os.path.join(root, "target"), t)
    ddir = write(os.path.join(root, "eagle3"), drafter_json(t, args.K, tiny))
    common = {**llm_engine_kwargs(batches, ctx, new, ahead=2 * (args.K + 1)), "dtype": "bfloat16"}
    rng, rows = np.random.default_rng(0), []

    llm = jspec.LLM(tdir, **common)
    expert_layer, other, L = expert_split(llm.engine.runner.params)
    E, k = t["num_local_experts"], t["num_experts_per_tok"]
    token_bytes = other + L * expert_layer * k / E
    bound_ms = token_bytes / Bps * 1e3
    print(f"gpt-oss {args.shape}: {L} layers x {E} experts ({k} a token), experts {L * expert_layer / 1e9:.2f} GB "
          f"packed, the rest {other / 1e9:.2f} GB; one token streams {token_bytes / 1e9:.3f} GB: {bound_ms:.3f} ms "
          f"at the probe's {bw['best_TBps']:.2f} TB/s", flush=True)
    plain = {}
    for B in batches:
        tot, pf = llm_run(llm, B, ctx, new, rng)
        t1 = (tot - pf) / (new - 1)
        plain[B] = t1
        rows.append(dict(method="plain", batch=B, tok_s=B * new / tot, step_ms=t1 * 1e3,
                         bound_ms=bound_ms if B == 1 else None, of_bound=bound_ms / (t1 * 1e3) if B == 1 else None))
        print(f"plain B={B:3d}: {B * new / tot:9.1f} tok/s with prefill, decode {t1 * 1e3:.3f} ms/step"
              + (f", bytes bound {bound_ms:.3f} ms -> {bound_ms / (t1 * 1e3):5.1%}" if B == 1 else ""), flush=True)
    del llm
    gc.collect()

    K = args.K
    touched = E * (1 - (1 - k / E) ** (K + 1))  # distinct experts K + 1 uniformly routed tokens reach, a layer
    verify_ratio = (other + L * expert_layer * touched / E) / token_bytes
    spec = {"method": "eagle3", "model": ddir, "num_speculative_tokens": K, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": float(args.taus.split(",")[0])}
    llm = jspec.LLM(tdir, speculative_config=spec, **{**common, "max_model_len": ctx + new + 64 + 2 * (K + 1)})
    eng = llm.engine
    dbytes = weight_bytes(eng.runner.dparams)
    for tau_want in (float(x) for x in args.taus.split(",")):
        eng.runner.synthetic_rates = jnp.asarray(conditional_rates(synthetic_rates_from_length(tau_want, K)),
                                                 jnp.float32)
        for B in batches:
            eng.spec_metrics.__init__()
            tot, pf = llm_run(llm, B, ctx, new, rng)
            tau = eng.spec_metrics.mean_acceptance_length
            step = (tot - pf) / (new - 1)  # seconds per generated token
            dec = plain[B] / step
            ideal = tau * plain[B] / (plain[B] * verify_ratio + K * dbytes / Bps) if B == 1 else None
            rows.append(dict(method="eagle3", batch=B, K=K, tau=tau, tok_s=B * new / tot, speedup_decode=dec,
                             ideal=ideal, of_ideal=dec / ideal if ideal else None, verify_ratio=verify_ratio,
                             drafter_bytes=dbytes))
            print(f"eagle3 B={B:3d} K={K} tau {tau:.2f}: {B * new / tot:9.1f} tok/s, decode speedup {dec:.2f}x"
                  + (f", physical ideal {ideal:.2f}x (verify {verify_ratio:.2f}x a token's bytes, chain "
                     f"{K} x {dbytes / 1e9:.3f} GB) -> {dec / ideal:5.1%}" if ideal else ""), flush=True)
    out = dict(shape=args.shape, config=t, bandwidth=bw, token_bytes=token_bytes, rows=rows, ctx=ctx, new=new)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
