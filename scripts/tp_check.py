"""Greedy outputs across tensor-parallel sizes on this machine's devices (issue 29): the
GPU / TPU counterpart of tests/parallel (whose CPU run uses the XLA references only).

The embedded model family (jspec.family: a trained ~10M Llama, 8 heads, 4 KV heads, and its
EAGLE3 / PEagle / DFlash drafters) in float32: trained weights give argmax margins far above
the last-bit differences of sharded sums (random weights do not: their near-uniform logits
tie). The default kernels run (on GPU: the paged-attention kernel per shard of KV heads
under shard_map; projections and the sampler through XLA once tp > 1). For each size of
--tps the greedy outputs of a batch, plain and with each drafter (sharded, and for EAGLE3
replicated too), must equal tp 1's plain outputs. One line per case; exit status 1 on a
mismatch.

    python scripts/tp_check.py --tps 1,2          # two GPUs
    python scripts/tp_check.py --tps 1,2,4,8
    python scripts/tp_check.py --tps 4            # tp 4 against tp 1's plain outputs
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tps", default="1,2")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--skip", default="", help="cases not run, by their printed names (e.g. 'plain,eagle3 draft_tp=4')")
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax

    import jspec

    prompts = ["import os\n\ndef ", "class Queue:\n    def __init__(self", "for i in range(", "# Copyright"]
    sp = jspec.SamplingParams(temperature=0.0, max_tokens=a.new, ignore_eos=True)
    kw = dict(dtype="float32", max_num_seqs=4, max_model_len=256)
    print(f"{jax.device_count()} x {jax.devices()[0].device_kind}", flush=True)
    want, ok = None, True
    cases = [None] + [{"method": m} for m in ("eagle3", "peagle", "dflash")] + [
        {"method": "eagle3", "draft_tensor_parallel_size": 1}]
    tps = [int(t) for t in a.tps.split(",")]
    skip = set(a.skip.split(","))
    if tps[0] != 1 or "plain" in skip:  # tp 1's plain outputs are the reference all the same
        want = [o.token_ids for o in jspec.LLM(None, **kw).generate(prompts, sp)]
        print("tp=1 plain (the reference)", flush=True)
    for tp in tps:
        for spec in cases:
            if spec is not None and spec.get("draft_tensor_parallel_size") == 1 and tp == 1:
                continue
            name = "plain" if spec is None else f"{spec['method']} draft_tp={spec.get('draft_tensor_parallel_size', tp)}"
            if name in skip:
                continue
            try:
                llm = jspec.LLM(None, speculative_config=spec, tensor_parallel_size=tp, **kw)
            except ValueError as e:  # a size that does not split this model or drafter
                print(f"tp={tp} {name:16s} not run: {e}", flush=True)
                continue
            outs = [o.token_ids for o in llm.generate(prompts, sp)]
            want = outs if want is None else want
            same = outs == want
            ok &= same
            print(f"tp={tp} {name:16s} attn={llm.engine.runner.plan.attn.name}: "
                  f"{'same as tp=1' if same else 'DIFFERENT'}", flush=True)
            del llm
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
