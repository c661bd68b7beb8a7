"""XLA's temporary bytes of an engine's step programs (issue 58: DFlash K=15 at 256 rows ran
out of memory in warmup): each program of the largest batch bucket and the largest general
step, compiled for this machine's backend (never run), with its argument, output and temp
sizes from ``compiled.memory_analysis()``.

    # the GPU: the real Qwen3-8B shape with DFlash K=15 at 256 rows
    PYTHONPATH=.:scripts python3 scripts/step_memory.py --method dflash --k 15 --max-num-seqs 256
    # any machine: tiny layers under the real vocabulary (the logits' arrays dominate the temporaries)
    PYTHONPATH=.:scripts python3 scripts/step_memory.py --method dflash --k 15 --max-num-seqs 256 --tiny-layers

Compare the largest temp with the KV pool's reserve (jspec/engine/kv_memory.py: TEMP_RESERVE,
LOGIT_COPIES). On a CPU the compiled buffers differ from the GPU's (DFlash K=15 at 256 rows,
Qwen3's vocabulary: 11.9 GiB on the CPU, one 16.31 GiB temp buffer on the H200).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

from bench_common import LLAMA_8B, QWEN3_8B, TINY, drafter_config
from bench_llm_folders import write_folders

GIB = 1 << 30


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="dflash", help="eagle3 (Llama-3.1-8B), dflash or peagle (Qwen3-8B)")
    ap.add_argument("--k", type=int, default=15, help="num_speculative_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=1328)
    ap.add_argument("--tiny-layers", action="store_true", help="tiny layers, the real vocabulary (any machine)")
    args = ap.parse_args(argv)
    import jspec
    from jspec.engine.warmup import empty_input

    shape = LLAMA_8B if args.method == "eagle3" else QWEN3_8B
    cfg = dataclasses.replace(TINY, family=shape.family, qk_norm=shape.qk_norm, vocab_size=shape.vocab_size) \
        if args.tiny_layers else shape
    tdir, ddir = write_folders(tempfile.mkdtemp(prefix="jspec_step_memory_"), cfg,
                               drafter_config(args.method, cfg, args.tiny_layers), args.k)
    N = args.max_num_seqs
    llm = jspec.LLM(tdir, speculative_config={"method": args.method, "model": ddir, "num_speculative_tokens": args.k},
                    dtype="bfloat16", load_format="dummy", max_num_seqs=N, max_model_len=args.max_model_len,
                    enable_prefix_caching=False, warmup=False,
                    num_pages=N * -(-args.max_model_len // 16) + 8)  # the programs' temporaries hardly depend on it
    r = llm.engine.runner
    shapes = r.warmup_shapes(1, True)
    most = max(s.tokens for s in shapes if not s.decode)
    print(f"{args.method} K={args.k}, vocabulary {cfg.vocab_size}, {N} rows ({'tiny layers' if args.tiny_layers else 'real layers'})")
    for sh in shapes:
        if (sh.decode and sh.seqs == N) or (not sh.decode and sh.tokens == most):
            name, a, kw = r._call(empty_input(r, sh), sh.steps, None, sh.filtering)
            m = getattr(r, name).lower(*a, **kw).compile().memory_analysis()
            print(f"  {'decode' if sh.decode else 'general'} tokens {sh.tokens}, rows {sh.seqs}, filtering "
                  f"{sh.filtering}: temp {m.temp_size_in_bytes / GIB:.2f} GiB, arguments "
                  f"{m.argument_size_in_bytes / GIB:.2f} GiB, outputs {m.output_size_in_bytes / GIB:.2f} GiB",
                  flush=True)


if __name__ == "__main__":
    main()
