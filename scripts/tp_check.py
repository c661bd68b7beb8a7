"""Greedy outputs across tensor-parallel sizes on this machine's devices (issue 29): the
GPU / TPU counterpart of tests/parallel (whose CPU run uses the XLA references only).

Random float32 weights (load_format="dummy", folders from scripts/bench_llm_folders.py),
the default kernels (on GPU: the paged-attention kernel per shard of KV heads under
shard_map; projections and the sampler through XLA once tp > 1). For each size of --tps the
greedy outputs of a batch, plain and with an EAGLE3 drafter (sharded and replicated), must
equal tp 1's plain outputs. Prints one line per case; exit status 1 on a mismatch.

    python scripts/tp_check.py --tps 1,2          # two GPUs
    python scripts/tp_check.py --tps 1,2,4,8
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tps", default="1,2")
    ap.add_argument("--new", type=int, default=24)
    a = ap.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]
    import jax
    import numpy as np
    from bench import TINY, drafter_config
    from bench_llm_folders import write_folders

    import jspec

    # Tiny, but with 8 query / 8 KV heads of 64 (the GPU attention kernel takes it) so the
    # KV cache shards up to tp 8.
    cfg = dataclasses.replace(TINY, hidden_size=256, num_heads=8, num_kv_heads=8, head_dim=64, intermediate_size=512)
    tdir, ddir = write_folders(tempfile.mkdtemp(prefix="jspec_tp_check_"), cfg, drafter_config("eagle3", cfg, True), 3)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (7, 30, 61, 100)]
    sp = jspec.SamplingParams(temperature=0.0, max_tokens=a.new, ignore_eos=True)
    kw = dict(dtype="float32", load_format="dummy", max_num_seqs=4, max_model_len=256, num_pages=128)
    print(f"{jax.device_count()} x {jax.devices()[0].device_kind}", flush=True)
    want, ok = None, True
    for tp in [int(t) for t in a.tps.split(",")]:
        for spec in (None, {"method": "eagle3", "model": ddir}, {"method": "eagle3", "model": ddir,
                                                                  "draft_tensor_parallel_size": 1}):
            if spec is not None and spec.get("draft_tensor_parallel_size") == 1 and tp == 1:
                continue
            llm = jspec.LLM(tdir, speculative_config=spec, tensor_parallel_size=tp, **kw)
            outs = [o.token_ids for o in llm.generate(prompts, sp)]
            want = outs if want is None else want
            same = outs == want
            ok &= same
            name = "plain" if spec is None else f"eagle3 draft_tp={spec.get('draft_tensor_parallel_size', tp)}"
            print(f"tp={tp} {name:16s} plan attn={llm.engine.runner.plan.attn}: "
                  f"{'same as tp=1' if same else 'DIFFERENT'}", flush=True)
            del llm
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
