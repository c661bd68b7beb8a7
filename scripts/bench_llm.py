"""scripts/bench.py's sections through jspec.LLM, the path users take: ``llm`` (every
drafter method and the plain engine at --spec-batches), ``moe`` (a Qwen3-30B-A3B-shaped
mixture-of-experts target) and ``structured`` (tok/s with and without a JSON schema). Each
section takes the parsed flags and the bandwidth probe and returns its JSON results."""

from __future__ import annotations

import dataclasses
import gc
import os

import bench_common
import jax.numpy as jnp
import numpy as np
from bench_common import (
    LLAMA_1B,
    LLAMA_8B,
    QWEN3_8B,
    QWEN3_30B_A3B,
    TINY,
    drafter_config,
    drafter_stream_bytes,
    llm_engine_kwargs,
    llm_run,
    physical_ideal,
)


def llm_section(args, bw):
    """Through jspec.LLM, the path users take: folders holding only config.json (the 8B shapes,
    scripts/bench_llm_folders.py), random weights by load_format="dummy", prompts of --llm-ctx
    random tokens, --llm-new greedy tokens, timed by LLM.generate with the prefill included and
    without (minus a 1-token run). Speculation with synthetic acceptance; the speedup over the
    plain engine of the same run against the physical ideal tau * T(1) / (T(1) + drafter bytes
    / bandwidth), T(1) the plain engine's decode time per step at that batch."""
    import tempfile

    from bench_llm_folders import write_folders, write_target_folder

    import jspec
    from jspec.drafters.loader import drafter_param_spec
    from kernels_pallas.synthetic import conditional_rates, synthetic_rates_from_length

    ctx, new = (64, 32) if args.quick else (args.llm_ctx, args.llm_new)
    batches = [int(b) for b in args.spec_batches.split(",")] if not args.quick else [1, 2]
    plan = {"eagle3": [(3, [2.5, 3.5]), (7, [3.5, 5.0])], "peagle": [(7, [3.5, 4.5])], "dflash": [(15, [4.24, 6.5])],
            "ngram": [(3, [2.5, 3.5]), (7, [3.5, 5.0])],  # ngram: no drafter weights, its ideal is tau
            "draft_model": [(3, [2.5, 3.5])]}  # Llama-3.2-1B's shape drafting for Llama-3.1-8B's
    ks = {int(k) for k in args.ks.split(",")} if args.ks else None
    rows, root = [], tempfile.mkdtemp(prefix="jspec_bench_llm_")
    rng = np.random.default_rng(0)
    common = llm_engine_kwargs(batches, ctx, new, ahead=2 * 17)
    plain_cache = {}
    for kind in args.methods.split(","):
        cfg = TINY if args.quick else (LLAMA_8B if kind in ("eagle3", "ngram", "draft_model") else QWEN3_8B)
        # ngram / draft_model: the target folder only from here
        dc = drafter_config("eagle3" if kind in ("ngram", "draft_model") else kind, cfg, args.quick)
        tdir, ddir = write_folders(root, cfg, dc, 3)
        if kind == "draft_model":
            ddir = write_target_folder(os.path.join(root, "draft-model"),
                                       dataclasses.replace(TINY, num_layers=2) if args.quick else LLAMA_1B)
        if cfg.family not in plain_cache:  # plain decode of this target, per batch
            llm = jspec.LLM(tdir, **common)
            plain_cache[cfg.family] = {}
            for B in batches:
                tot, pf = llm_run(llm, B, ctx, new, rng)
                plain_cache[cfg.family][B] = (tot, pf)
                print(f"llm plain {cfg.family} B={B:2d}: {B * new / tot:8.1f} tok/s with prefill ({tot:.3f} s, "
                      f"prefill {pf:.3f} s), decode {(tot - pf) / (new - 1) * 1e3:.2f} ms/step", flush=True)
            del llm
            gc.collect()  # the engine's jitted methods hold it in reference cycles: free its buffers now
        for K, lengths in plan[kind]:
            if ks is not None and K not in ks:
                continue
            spec = {"method": kind, **({} if kind == "ngram" else {"model": ddir}), "num_speculative_tokens": K,
                    "rejection_sample_method": "synthetic", "synthetic_acceptance_length": lengths[0],
                    **({"dynamic": True} if args.dynamic else {})}
            llm = jspec.LLM(tdir, speculative_config=spec, **{**common, "max_model_len": ctx + new + 64 + 2 * (K + 1)})
            eng = llm.engine
            dbytes = drafter_stream_bytes(cfg, eng.dcfg, eng.runner.dparams)
            if kind not in ("ngram", "draft_model"):
                assert {s.path for s in drafter_param_spec(eng.dcfg)}  # the dummy tree follows the spec
            for length in lengths:
                eng.runner.synthetic_rates = jnp.asarray(
                    conditional_rates(synthetic_rates_from_length(length, K)), jnp.float32)
                for B in batches:
                    eng.spec_metrics.__init__()
                    before = eng.stats().get("decode_steps_by_width", {})
                    tot, pf = llm_run(llm, B, ctx, new, rng)
                    after = eng.stats().get("decode_steps_by_width", {})
                    widths = {q: n - before.get(q, 0) for q, n in after.items()}
                    tau = eng.spec_metrics.mean_acceptance_length
                    ptot, ppf = plain_cache[cfg.family][B]
                    t1 = (ptot - ppf) / (new - 1)
                    ideal = physical_ideal(tau, t1, dbytes, bw["best_TBps"] * 1e12)
                    dec = (ptot - ppf) / (tot - pf)
                    row = dict(method=kind, dynamic=args.dynamic, batch=B, K=K,
                               synthetic_length=length, tau=tau, ctx=ctx, new=new,
                               tok_s=B * new / tot, plain_tok_s=B * new / ptot, speedup_e2e=ptot / tot,
                               speedup_decode=dec, ideal=ideal, of_ideal=dec / ideal, t1_ms=t1 * 1e3,
                               draft_bound_ms=dbytes / (bw["best_TBps"] * 1e12) * 1e3, drafter_bytes=dbytes,
                               decode_steps_by_width=widths)
                    rows.append(row)
                    print(f"llm {kind} B={B:2d} K={K:2d} L={length}: tau {tau:.2f} {row['tok_s']:8.1f} tok/s with "
                          f"prefill (plain {row['plain_tok_s']:7.1f}, {row['speedup_e2e']:.2f}x); decode speedup "
                          f"{dec:.2f}x, physical ideal {ideal:.2f}x -> {dec / ideal:5.1%} (T1 {t1 * 1e3:.2f} ms, "
                          f"drafter bytes/bw {row['draft_bound_ms']:.2f} ms)"
                          + (f"; decode steps by width {widths}" if widths else ""), flush=True)
            del llm, eng
            gc.collect()
    return dict(rows=rows)


def moe_active_bytes(c, itemsize: int = 2) -> int:
    """Weight bytes one decode token streams through a MoE target: every attention and norm
    weight, the routers, num_experts_per_tok experts a layer, the lm_head and one embedding row."""
    H = c.hidden_size
    attn = H * (c.q_size + 2 * c.kv_size) + c.q_size * H + 2 * H + (2 * c.head_dim if c.qk_norm else 0)
    moe = c.num_experts * H + c.num_experts_per_tok * 3 * H * c.moe_intermediate_size
    return itemsize * (c.num_layers * (attn + moe) + c.vocab_size * H + 2 * H)


def moe_section(args, bw):
    """A Qwen3 mixture-of-experts target (Qwen3-30B-A3B's shape, random bf16 weights) through
    jspec.LLM: plain decode per batch against the bytes one token's experts stream (the
    batch-1 bound; a batch's rows pick more experts), and n-gram speculation with synthetic
    acceptance at batch 1 (no drafter weights: its ideal is tau), whose K + 1 verified tokens
    route to more experts than one."""
    import tempfile

    from bench_llm_folders import write_target_folder

    import jspec
    from kernels_pallas.synthetic import conditional_rates, synthetic_rates_from_length

    cfg = dataclasses.replace(TINY, family="qwen3", qk_norm=True, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=64, moe_layers=tuple(range(TINY.num_layers))) \
        if args.quick else QWEN3_30B_A3B
    ctx, new = (64, 32) if args.quick else (args.llm_ctx, args.llm_new)
    batches = [int(b) for b in args.spec_batches.split(",")] if not args.quick else [1, 2]
    folder = write_target_folder(os.path.join(tempfile.mkdtemp(prefix="jspec_bench_moe_"), "target"), cfg)
    common = llm_engine_kwargs(batches, ctx, new, ahead=2 * 4)  # the n-gram rows: 2 (K + 1), K = 3
    rng, rows = np.random.default_rng(0), []
    active = moe_active_bytes(cfg)
    bound_ms = active / (bw["best_TBps"] * 1e12) * 1e3
    print(f"moe {cfg.num_layers} layers x {cfg.num_experts} experts ({cfg.num_experts_per_tok} a token): "
          f"{cfg.num_params() / 1e9:.1f}B parameters, {active / 1e9:.2f} GB streamed per token "
          f"({bound_ms:.2f} ms at the probe)", flush=True)
    llm = jspec.LLM(folder, **common)
    plain = {}
    for B in batches:
        tot, pf = llm_run(llm, B, ctx, new, rng)
        t1 = (tot - pf) / (new - 1)
        plain[B] = (tot, pf, t1)
        rows.append(dict(method="plain", batch=B, tok_s=B * new / tot, t1_ms=t1 * 1e3, bound_ms=bound_ms,
                         of_bound=bound_ms / (t1 * 1e3) if B == 1 else None))
        print(f"moe plain B={B:2d}: {B * new / tot:8.1f} tok/s with prefill (prefill {pf:.3f} s), decode "
              f"{t1 * 1e3:.2f} ms/step" + (f", bound {bound_ms:.2f} ms -> {bound_ms / (t1 * 1e3):5.1%}"
                                           if B == 1 else ""), flush=True)
    del llm
    gc.collect()
    K = 3
    spec = {"method": "ngram", "num_speculative_tokens": K, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": 2.5}
    llm = jspec.LLM(folder, speculative_config=spec, **{**common, "max_model_len": ctx + new + 64 + 2 * (K + 1)})
    eng = llm.engine
    for length in (2.5, 3.5):
        eng.runner.synthetic_rates = jnp.asarray(conditional_rates(synthetic_rates_from_length(length, K)), jnp.float32)
        eng.spec_metrics.__init__()
        tot, pf = llm_run(llm, 1, ctx, new, rng)
        tau = eng.spec_metrics.mean_acceptance_length
        ptot, ppf, t1 = plain[1]
        dec = (ptot - ppf) / (tot - pf)
        rows.append(dict(method="ngram", batch=1, K=K, tau=tau, speedup_decode=dec, of_ideal=dec / tau,
                         step_ms=t1 * tau / dec * 1e3))
        print(f"moe ngram B= 1 K={K} L={length}: tau {tau:.2f}, decode speedup {dec:.2f}x, ideal (no drafter "
              f"weights) {tau:.2f}x -> {dec / tau:5.1%}; step {t1 * tau / dec * 1e3:.2f} ms against T(1) "
              f"{t1 * 1e3:.2f} ms", flush=True)
    return dict(rows=rows, active_bytes=active)


# A schema no row can complete within --llm-new tokens (at least 2000 integers), so every row
# runs the full count with and without it.
STRUCTURED_SCHEMA = {"type": "object", "properties": {"values": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 2000}},
    "required": ["values"], "additionalProperties": False}


def structured_section(args, bw):
    """Structured outputs (issue 27) through jspec.LLM on the Llama 8B shape: random weights
    (load_format="dummy") and a byte-level BPE tokenizer of the model's vocabulary size
    (bench_llm_folders.write_tokenizer), --spec-batches rows of --llm-ctx random prompt tokens
    and --llm-new greedy tokens, tok/s without and with a JSON schema (STRUCTURED_SCHEMA:
    every output token masked by the grammar, its masks built on the host each step)."""
    import tempfile

    from bench_llm_folders import write_folders, write_tokenizer

    import jspec

    ctx, new = (64, 32) if args.quick else (args.llm_ctx, args.llm_new)
    batches = [int(b) for b in args.spec_batches.split(",")] if not args.quick else [1, 2]
    cfg = TINY if args.quick else LLAMA_8B
    tdir, _ = write_folders(tempfile.mkdtemp(prefix="jspec_bench_structured_"), cfg, drafter_config("eagle3", cfg,
                                                                                                    args.quick), 3)
    write_tokenizer(tdir, cfg.vocab_size)
    llm = jspec.LLM(tdir, dtype="bfloat16", load_format="dummy", max_num_seqs=max(batches),
                    enable_prefix_caching=False, max_model_len=ctx + new + 64, linear_impl=bench_common.LINEAR_IMPL,
                    attn_impl=bench_common.ATTN_IMPL, quantization=bench_common.QUANTIZATION)
    so = jspec.StructuredOutputsParams(json=STRUCTURED_SCHEMA)
    rng, rows = np.random.default_rng(0), []
    for B in batches:
        (tot, pf), (stot, spf) = llm_run(llm, B, ctx, new, rng), llm_run(llm, B, ctx, new, rng, so)
        row = dict(batch=B, ctx=ctx, new=new, tok_s=B * new / tot, json_tok_s=B * new / stot,
                   decode_ms=(tot - pf) / (new - 1) * 1e3, json_decode_ms=(stot - spf) / (new - 1) * 1e3)
        row["slowdown"] = 1 - row["json_tok_s"] / row["tok_s"]
        rows.append(row)
        print(f"structured B={B:2d}: {row['tok_s']:8.1f} tok/s plain, {row['json_tok_s']:8.1f} tok/s with the JSON "
              f"schema ({row['slowdown']:+.1%} slower); decode {row['decode_ms']:.2f} -> {row['json_decode_ms']:.2f} "
              f"ms/step", flush=True)
    out = llm.generate([[1, 2, 3]], jspec.SamplingParams(temperature=0, max_tokens=16, structured_outputs=so))[0]
    text, head = "".join(out.outputs[0].text.split()), '{"values":['  # the mask held (whitespace is free)
    assert text.startswith(head) or head.startswith(text), out.outputs[0].text
    return dict(rows=rows)

