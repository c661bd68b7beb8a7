"""Probe: a width-1 decode step with an EAGLE3 drafter against a plain step,
8B, 64 rows at ctx 1024: engine step wall time and GPU time by kernel over engine steps."""
import collections, sys
import jax, jax.numpy as jnp, numpy as np
import bench_common
from bench_common import LLAMA_8B, make_engine, random_tree, engine_decode, inject, compile_decode, clear, drafter_setup
from gpu_trace import traced_events
from jspec.checkpoint.target import target_param_spec

B, ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 64, 1024
rng = np.random.default_rng(0)
cfg = LLAMA_8B if jax.default_backend() == 'gpu' else bench_common.TINY
if cfg is not LLAMA_8B: B, ctx = 4, 64
params = random_tree(target_param_spec(cfg), jnp.bfloat16, 0)

def profile(eng, label):
    step, tps, _ = engine_decode(eng, B, ctx, rng, 48)
    step, tps, _ = engine_decode(eng, B, ctx, rng, 96)
    print(f"{label}: engine step median {step*1e3:.3f} ms, {tps:.0f} tok/s", flush=True)
    if jax.default_backend() != 'gpu':
        return {}
    seqs = inject(eng, B, ctx, rng, max_tokens=400)
    compile_decode(eng, B, ctx, 1)
    for _ in range(4):
        eng.step()
    reps = 20
    ev = traced_events(lambda: eng.step(), [()], reps=reps)
    tot, cnt = collections.Counter(), collections.Counter()
    for n, ns, _ in ev:
        tot[n] += ns; cnt[n] += 1
    print(f"{label}: GPU busy {sum(tot.values())/reps/1e3:.1f} us/step, {len(ev)/reps:.0f} kernels/step", flush=True)
    for n, ns in tot.most_common(40):
        print(f"  {ns/reps/1e3:8.1f} us x{cnt[n]/reps:5.1f}  {n[:100]}", flush=True)
    clear(eng)
    return {n: ns / reps / 1e3 for n, ns in tot.items()}

plain = make_engine(cfg, params, max_num_seqs=B, ctx=ctx, dtype="bfloat16", extra=600)
p = profile(plain, "plain")
del plain
dc, dparams = drafter_setup("eagle3", cfg, cfg is not LLAMA_8B)
spec = {"method": "eagle3", "model": "random-eagle3", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
        "synthetic_acceptance_length": 1.3, "dynamic": True}
eng = make_engine(cfg, params, max_num_seqs=B, ctx=ctx, dtype="bfloat16", spec=spec, drafter=(dc, dparams), extra=600)
s = profile(eng, "eagle3 dynamic")
print("widths", eng.stats().get("decode_steps_by_width"), "tau", eng.spec_metrics.mean_acceptance_length, "times", {k: round(v*1e3, 2) for k, v in eng.policy.times.items()})
print("largest differences (spec - plain), us/step:")
names = set(p) | set(s)
for n in sorted(names, key=lambda n: -abs(s.get(n, 0) - p.get(n, 0)))[:30]:
    print(f"  {s.get(n,0)-p.get(n,0):+8.1f}  (plain {p.get(n,0):7.1f}, spec {s.get(n,0):7.1f})  {n[:100]}")
