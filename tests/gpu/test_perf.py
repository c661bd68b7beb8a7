"""The GPU check's quick performance table (scripts/gpu_check.py runs it alone on the device,
after the lines of test_lines.py, and writes its rows below them in docs/gpu_check.md):
scripts/bench.py's measurements through scripts/bench_common.py. Skipped on a CPU."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))  # bench_common


def perf(steps: int) -> list[dict]:
    """Batch 1, ctx 512, bf16, through LLMEngine.step (bench_common.py's engine_decode): plain
    Llama-3.1-8B, EAGLE3 K=3 at synthetic acceptance length 3.5, DFlash block 16 at 6.5
    (on the same Llama shape, to keep the call short), each beside the physical ideal
    tau * T(1) / (T(1) + drafter weight bytes / bandwidth), bandwidth probed here. Rows:
    the plain one (tok_s, t1_ms, bw_TBps, roofline_frac), then one a drafter (method, tau,
    tok_s, speedup, ideal, frac_of_ideal, tk1_over_t1, draft_ms, draft_bound_ms,
    draft_over_bound)."""
    import bench_common as bench
    import jax
    import jax.numpy as jnp

    from jspec.checkpoint.target import target_param_spec
    from kernels_pallas.synthetic import conditional_rates, synthetic_rates_from_length

    bw = bench.measure_bandwidth(False)["best_TBps"] * 1e12
    cfg = bench.LLAMA_8B
    params = bench.random_tree(target_param_spec(cfg), jnp.bfloat16, 0)
    rng = np.random.default_rng(0)
    ctx = 512
    base = bench.make_engine(cfg, params, max_num_seqs=1, ctx=ctx, dtype="bfloat16")
    t1, tps1, _ = bench.engine_decode(base, 1, ctx, rng, steps)
    rows = [dict(method="plain", K=0, tau=1.0, tok_s=tps1, speedup=1.0, t1_ms=t1 * 1e3, bw_TBps=bw / 1e12,
                 roofline_frac=bench.weight_bytes(params) / bw / t1)]
    for kind, K, length in (("eagle3", 3, 3.5), ("dflash", 15, 6.5)):
        # The target forward verifying K + 1 tokens against decoding one, by GPU time (what
        # the device spends; a synchronised single call's wall time adds the host's launches).
        gpu = jax.default_backend() == "gpu"
        tk = bench.target_forward_time(base, 1, ctx, rng, K + 1, gpu_time=gpu)
        tk = tk / bench.target_forward_time(base, 1, ctx, rng, 1, gpu_time=gpu)
        dc, dparams = bench.drafter_setup(kind, cfg, False)
        dbytes = bench.drafter_stream_bytes(cfg, dc, dparams)
        spec = {"method": kind, "model": f"random-{kind}", "num_speculative_tokens": K,
                "rejection_sample_method": "synthetic", "synthetic_acceptance_length": length}
        eng = bench.make_engine(cfg, params, max_num_seqs=1, ctx=ctx, dtype="bfloat16", spec=spec,
                                drafter=(dc, dparams), extra=(steps + 8) * (K + 1) + 64)
        td = bench.draft_time(eng, 1, ctx, rng, K)
        eng.runner.synthetic_rates = jnp.asarray(conditional_rates(synthetic_rates_from_length(length, K)), jnp.float32)
        _, tps, _ = bench.engine_decode(eng, 1, ctx, rng, steps)
        tau = eng.spec_metrics.mean_acceptance_length
        ideal = bench.physical_ideal(tau, t1, dbytes, bw)
        rows.append(dict(method=f"{kind} K={K}", K=K, tau=tau, tok_s=tps, speedup=tps / tps1, ideal=ideal,
                         frac_of_ideal=tps / tps1 / ideal, tk1_over_t1=tk, draft_ms=td * 1e3,
                         draft_bound_ms=dbytes / bw * 1e3, draft_over_bound=td / (dbytes / bw)))
        del eng
        jax.clear_caches()
    return rows


@pytest.mark.gpu(group="perf", line="quick performance table")
def test_perf_table(on_gpu, perf_steps, record_property):
    if not on_gpu:
        pytest.skip("needs a GPU: measures the device's bandwidth and decode speed")
    rows = perf(perf_steps)
    assert rows[0]["tok_s"] > 0 and all(r["tau"] >= 1 for r in rows), rows
    record_property("perf", rows)
    record_property("detail", f"plain {rows[0]['tok_s']:.1f} tok/s; "
                    + "; ".join(f"{r['method']} {r['speedup']:.2f}x, {r['frac_of_ideal']:.1%} of ideal" for r in rows[1:]))
