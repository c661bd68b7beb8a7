"""``python -m jspec.train``: train jspec's small model family on the Python stdlib.

  python -m jspec.train --stage all --out runs/family          # tokenizer, target, 3 drafters
  python -m jspec.train --stage eagle3 --out runs/family --drafter-steps 2000
  python -m jspec.train --stage accept --out runs/family              # greedy acceptance, held out
  python -m jspec.train --stage tokenizer,generate,dflash --out runs/d \
      --tokenizer-from jspec/family/jspec-stdlib-10m                  # a new drafter for a trained target
                                                                      # (its folder copied to runs/d/target)
  python -m jspec.train --stage all --out /tmp/t --preset tiny --max-files 40 --steps 50 \\
      --drafter-steps 20 --seq-len 64 --batch-size 8                 # a CPU smoke run

See docs/training.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from jspec.train import drafters, pipeline, target


def parse_args(argv=None) -> tuple[pipeline.RunConfig, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m jspec.train", description=__doc__.splitlines()[0])
    ap.add_argument("--stage", default="all", help=f"one of {', '.join(pipeline.STAGES)}, 'drafters', 'all' (the "
                    "six) or 'accept' (greedy acceptance on held-out files); comma-separated for several")
    ap.add_argument("--out", required=True, help="output folder (one sub-folder per stage)")
    ap.add_argument("--preset", default="small", choices=sorted(target.PRESETS), help="target size preset")
    for f in dataclasses.fields(target.TargetSize):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None,
                        help=f"target {f.name} (overrides the preset)")
    ap.add_argument("--max-files", type=int, default=None, help="first N stdlib files only (quick runs)")
    d = pipeline.RunConfig(out="")
    for name in ("seq_len", "batch_size", "steps", "drafter_steps", "lr", "drafter_lr", "warmup_steps", "seed",
                 "log_every", "eval_batches", "ttt_steps", "ttt_decay", "peagle_ratio", "peagle_ratio_min",
                 "dflash_anchors", "dflash_gamma", "accept_prompts", "accept_prompt_tokens", "accept_max_tokens"):
        v = getattr(d, name)
        ap.add_argument("--" + name.replace("_", "-"), type=type(v), default=v)
    ap.add_argument("--drafter-data", default=d.drafter_data, choices=pipeline.DRAFTER_DATA,
                    help="the drafters' rows: the target's greedy continuations (the generate stage) or the corpus")
    ap.add_argument("--tokenizer-from", default=None,
                    help="encode the corpus with this folder's tokenizer instead of training one")
    ap.add_argument("--drafter-init", default=None,
                    help="a trained drafter folder (of the stage's method) to start from instead of random weights")
    g = d.generate
    ap.add_argument("--generate-rows", type=int, default=g.rows, help="rows the generate stage writes")
    ap.add_argument("--generate-prompt-min", type=int, default=g.prompt_min, help="shortest prompt (tokens)")
    ap.add_argument("--generate-prompt-max", type=int, default=g.prompt_max, help="longest prompt (tokens)")
    ap.add_argument("--generate-batch", type=int, default=g.max_num_seqs, help="rows decoded together")
    ap.add_argument("--dtype", default=d.dtype, choices=sorted(pipeline.DTYPES), help="compute dtype")
    ap.add_argument("--save-dtype", default=d.save_dtype, choices=sorted(pipeline.DTYPES))
    for m, s in drafters.DEFAULTS.items():
        ap.add_argument(f"--{m}-layers", type=int, default=s.num_layers)
    ap.add_argument("--eagle3-k", type=int, default=drafters.DEFAULTS["eagle3"].num_speculative_tokens,
                    help="EAGLE3's proposal default K (written to its config)")
    ap.add_argument("--peagle-k", type=int, default=drafters.DEFAULTS["peagle"].num_speculative_tokens,
                    help="PEagle's K: the depths trained and the proposal default")
    ap.add_argument("--dflash-block-size", type=int, default=drafters.DEFAULTS["dflash"].block_size)
    ap.add_argument("--dflash-k", type=int, default=None,
                    help="DFlash's proposal default K written to its config (default: the whole block, block size - 1)")
    a = ap.parse_args(argv)

    size = dataclasses.replace(target.PRESETS[a.preset], **{
        f.name: getattr(a, f.name) for f in dataclasses.fields(target.TargetSize) if getattr(a, f.name) is not None})
    sizes = (
        dataclasses.replace(drafters.DEFAULTS["eagle3"], num_layers=a.eagle3_layers, num_speculative_tokens=a.eagle3_k),
        dataclasses.replace(drafters.DEFAULTS["peagle"], num_layers=a.peagle_layers, num_speculative_tokens=a.peagle_k),
        dataclasses.replace(drafters.DEFAULTS["dflash"], num_layers=a.dflash_layers, block_size=a.dflash_block_size,
                            num_speculative_tokens=a.dflash_k or a.dflash_block_size - 1),
    )
    gen = pipeline.generate.GenerateConfig(rows=a.generate_rows, prompt_min=a.generate_prompt_min,
                                           prompt_max=a.generate_prompt_max, max_num_seqs=a.generate_batch,
                                           seed=a.seed)
    rc = pipeline.RunConfig(
        out=a.out, target=size, drafter_sizes=sizes, max_files=a.max_files, dtype=a.dtype, save_dtype=a.save_dtype,
        drafter_data=a.drafter_data, generate=gen, tokenizer_from=a.tokenizer_from, drafter_init=a.drafter_init,
        **{n: getattr(a, n) for n in ("seq_len", "batch_size", "steps", "drafter_steps", "lr", "drafter_lr",
                                      "warmup_steps", "seed", "log_every", "eval_batches", "ttt_steps", "ttt_decay",
                                      "peagle_ratio", "peagle_ratio_min", "dflash_anchors", "dflash_gamma",
                                      "accept_prompts", "accept_prompt_tokens", "accept_max_tokens")},
    )
    stages: list[str] = []
    for s in a.stage.split(","):
        stages += {"all": list(pipeline.STAGES), "drafters": ["eagle3", "peagle", "dflash"]}.get(s, [s])
    for s in stages:
        if s not in (*pipeline.STAGES, "accept"):
            ap.error(f"unknown stage {s!r}")
    return rc, stages


def main(argv=None):
    rc, stages = parse_args(argv)
    print("settings:", json.dumps(dataclasses.asdict(rc), default=str))
    pipeline.run(rc, stages)


if __name__ == "__main__":
    main()
