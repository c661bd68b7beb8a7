"""ops.moe's few-pair kernels (kernels_pallas/moe_experts.py) off and on, at the step level:
plain decode of a Qwen3-30B-A3B-shaped target (random bf16) through jspec.LLM at batches 1, 4
and 16 (8, 32 and 128 token-expert pairs a layer), twice each way, in one process. What
ops.MOE_KERNEL_MIN_FRACTION was set from.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.:scripts python3 scripts/bench_moe_kernel_ab.py

Raw results: docs/bench/2026-11-27_moe_kernel_ab_h100.log.
"""

from __future__ import annotations

import gc
import os
import tempfile

import numpy as np
from bench_common import QWEN3_30B_A3B, llm_engine_kwargs, llm_run
from bench_llm_folders import write_target_folder

import jspec
from jspec import ops


def main():
    folder = write_target_folder(os.path.join(tempfile.mkdtemp(prefix="jspec_moe_ab_"), "target"), QWEN3_30B_A3B)
    batches, ctx, new = [1, 4, 16], 512, 64
    common = llm_engine_kwargs(batches, ctx, new, ahead=8)
    rng = np.random.default_rng(0)
    for rep in range(2):
        for on in (False, True):
            ops.MOE_KERNEL_MIN_FRACTION = 0.0 if on else 2.0  # every few-pair call / none
            llm = jspec.LLM(folder, **common)
            for B in batches:
                tot, pf = llm_run(llm, B, ctx, new, rng)
                print(f"rep {rep} kernel {'on ' if on else 'off'} B={B:2d} ({B * 8:3d} pairs): decode "
                      f"{(tot - pf) / (new - 1) * 1e3:.3f} ms/step", flush=True)
            del llm
            gc.collect()


if __name__ == "__main__":
    main()
