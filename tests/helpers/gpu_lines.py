"""The checkpoints of the GPU check's lines (tests/gpu, run by scripts/gpu_check.py) and what
the lines share with their builder.

The GPU machine has no torch models to build from and little time, so ``build`` writes the
tiny checkpoints of tests/helpers/spec_e2e.py and the transformers references once on a
CPU machine (``python scripts/gpu_check.py --build DIR``); ``use_checkpoints`` points
spec_e2e at that folder on the GPU machine, so that no torch model is rebuilt there.
"""

from __future__ import annotations

import json
import os

import numpy as np

# (drafter name in tests/helpers/spec_e2e.py, K, what it covers)
DRAFTERS = [
    ("eagle3", 3, "EAGLE3 speculators, reduced vocabulary (d2t)"),
    ("eagle3_full", 3, "EAGLE3 speculators, full vocabulary"),
    ("eagle3_orig", 7, "EAGLE3 original layout (midlayer.*)"),
    ("peagle", 7, "PEagle speculators"),
    ("dflash4", 3, "DFlash speculators"),
    ("dflash8_zlab", 7, "DFlash z-lab layout"),
    ("draft_llama", 3, "a draft model (2-layer Llama, method draft_model)"),
]
FALLBACK_PROMPT_LEN, FALLBACK_TOKENS = 12, 12  # the head_dim 24 line's prompt and greedy tokens
MOE_TOKENS = 16  # greedy tokens of each of the mixture-of-experts line's two prompts
FP8_TOKENS = 16  # greedy tokens of each of the FP8 target line's prompts


def build(folder: str):
    """Tiny checkpoints and the transformers references into ``folder`` (CPU; needs torch +
    speculators): spec_e2e's target (``target/``) and every drafter of ``DRAFTERS`` (one
    folder each), a head_dim 24 Qwen3 (``qwen3_hd24/``), a Qwen3 mixture of experts
    (``qwen3_moe/``), spec_e2e's target as FP8 checkpoints (``build_fp8``), a gpt-oss target
    (``build_gpt_oss``), and ``references.json``: transformers' greedy tokens of all but the first."""
    from tests.helpers import spec_e2e as h
    from tests.helpers.targets import build_hf_model, hf_greedy

    os.makedirs(folder, exist_ok=True)
    h._CACHE["root"] = os.path.abspath(folder)
    h.target()
    for name, _, _ in DRAFTERS:
        h.drafter(name)
    qwen = build_hf_model("qwen3")  # head_dim 24: no GPU kernel takes it
    qwen.save_pretrained(os.path.join(folder, "qwen3_hd24"))
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 384, size=FALLBACK_PROMPT_LEN)]
    refs = {"qwen3_hd24": {"prompt": prompt, "greedy": hf_greedy(qwen, prompt, FALLBACK_TOKENS)}}
    moe = build_hf_model("qwen3_moe")  # a Qwen3 mixture-of-experts target (8 experts, 2 a token)
    moe.save_pretrained(os.path.join(folder, "qwen3_moe"))
    prompts = [[int(t) for t in np.random.default_rng(5 + i).integers(3, 384, size=n)] for i, n in enumerate((7, 30))]
    refs["qwen3_moe"] = {"prompts": prompts, "greedy": [hf_greedy(moe, p, MOE_TOKENS) for p in prompts]}
    with open(os.path.join(folder, "references.json"), "w") as f:
        json.dump(refs, f)
    build_fp8(folder)
    build_gpt_oss(folder)
    print(f"built {sorted(os.listdir(folder))} under {folder}")


# The FP8 checkpoints of spec_e2e's target (build_fp8): folder -> (format, block)
FP8_TARGETS = {"target_fp8": ("ct_channel", (128, 128)), "target_fp8_block": ("fp8_block", (16, 16))}


def build_fp8(folder: str):
    """spec_e2e's target as FP8 checkpoints (FP8_TARGETS: compressed-tensors per output
    channel, and quant_method fp8 with 16 x 16 blocks; its planted feature survives, so an
    EAGLE3 drafter's proposals are accepted) and transformers' greedy tokens of their
    dequantized weights (float32) for two prompts, added to ``folder``'s references.json."""
    from tests.helpers import spec_e2e as h
    from tests.helpers.fp8 import write_fp8
    from tests.helpers.targets import hf_greedy

    prompts = h.varied_prompts(2, 5, 30, seed=6)
    path = os.path.join(folder, "references.json")
    with open(path) as f:
        refs = json.load(f)
    for name, (fmt, block) in FP8_TARGETS.items():
        _, _, ref = write_fp8(h.build_target(), os.path.join(folder, name), fmt, block)
        refs[name] = {"prompts": prompts, "greedy": [hf_greedy(ref, p, FP8_TOKENS) for p in prompts]}
    with open(path, "w") as f:
        json.dump(refs, f)


GPT_OSS_TOKENS = 16  # greedy tokens of each of the gpt-oss lines' prompts


def build_gpt_oss(folder: str):
    """tests/helpers/gpt_oss.py's target (``gpt_oss/target``), its MXFP4 copy (``gpt_oss/mxfp4``)
    and EAGLE3 drafter (``gpt_oss/eagle3``), and transformers' greedy tokens of both targets
    for two prompts (its window of 8 passed), added to ``folder``'s references.json."""
    from tests.helpers import gpt_oss
    from tests.helpers import spec_e2e as h
    from tests.helpers.targets import hf_greedy

    built = gpt_oss.build(os.path.join(folder, "gpt_oss"))
    prompts = h.varied_prompts(2, 5, 30, seed=8)
    path = os.path.join(folder, "references.json")
    with open(path) as f:
        refs = json.load(f)
    for name, hf in (("target", built["hf"]), ("mxfp4", built["hf_mxfp4"])):
        refs[f"gpt_oss/{name}"] = {"prompts": prompts, "greedy": [hf_greedy(hf, p, GPT_OSS_TOKENS) for p in prompts]}
    with open(path, "w") as f:
        json.dump(refs, f)


def use_checkpoints(folder: str) -> dict:
    """Point tests/helpers/spec_e2e.py at the folders ``build`` wrote under ``folder`` (no
    torch model is rebuilt) and return its references.json. Raises FileNotFoundError, with
    the command that builds them, if a drafter's folder is missing."""
    from tests.helpers import spec_e2e as h

    folder = os.path.abspath(folder)
    h._CACHE["root"] = folder
    h._CACHE["target"] = (os.path.join(folder, "target"), None)
    for name, _, _ in DRAFTERS:
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: run `python scripts/gpu_check.py --build {folder}` on a CPU machine first")
        h._CACHE[("drafter", name)] = path
    with open(os.path.join(folder, "references.json")) as f:
        return json.load(f)


def fp8_gemms(hlo: str) -> list[str]:
    """The GEMMs of a compiled program (``compiled.as_text()``) that multiply FP8 values:
    cuBLASLt's FP8 custom calls (their targets), and dots (a Triton GEMM fusion's) whose two
    operands are float8_e4m3fn (their names). Operand types are looked up in the dot's own
    computation; a dot after a conversion of FP8 values (XLA:CPU's, a weight-only dot) is no
    FP8 GEMM."""
    import re

    found = re.findall(r'custom_call_target="([^"]*\$f8[^"]*)"', hlo)
    for comp in hlo.split("\n\n"):
        types = dict(re.findall(r"^\s*(?:ROOT )?(%[\w.\-]+) = (\w+)\[", comp, re.M))
        for name, args in re.findall(r"^\s*(?:ROOT )?(%[\w.\-]+) = [^\n]*? dot\(([^)]*)\)", comp, re.M):
            operands = [a.strip() for a in args.split(", ")]
            if len(operands) == 2 and all("f8e4m3fn" in a or types.get(a.split()[-1], "") == "f8e4m3fn"
                                          for a in operands):
                found.append(name)
    return found
