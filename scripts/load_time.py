"""Load time of a ~1B-parameter random Llama: safetensors streaming vs orbax restore.

    python scripts/load_time.py [--dir /tmp/jspec-1b] [--dtype bfloat16]

Writes a random checkpoint with numpy (no torch), converts it with
scripts/convert_to_orbax.py's convert(), then times load_target on both folders (each
in a fresh process, so no cache is shared). Prints a markdown row for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}  # the Llama-3.2-1B shape: 1.24B parameters


def write_random(folder: str):
    import ml_dtypes
    from safetensors.numpy import save_file

    from jspec.checkpoint.target import target_param_spec
    from jspec.config import model_config_from_hf

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    rng = np.random.default_rng(0)
    tensors = {}
    for spec in target_param_spec(model_config_from_hf(CONFIG)):
        for name, shape in zip(spec.sources, spec.source_shapes):
            tensors[name] = (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def timed_load(folder: str, dtype: str) -> float:
    code = ("import time, jax; from jspec.checkpoint.target import load_target; t=time.perf_counter(); "
            f"c, p = load_target({folder!r}, {dtype!r}); jax.block_until_ready(p); print(time.perf_counter()-t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/jspec-1b")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    hf, ob = os.path.join(a.dir, "hf"), os.path.join(a.dir, "orbax")
    if not os.path.exists(os.path.join(hf, "model.safetensors")):
        write_random(hf)
    if not os.path.isdir(os.path.join(ob, "orbax_params")):
        sys.path.insert(0, os.path.dirname(__file__))
        from convert_to_orbax import convert

        convert(hf, ob, a.dtype)
    t_st, t_ob = timed_load(hf, a.dtype), timed_load(ob, a.dtype)
    import jax

    print(f"| {jax.devices()[0].device_kind} | jax {jax.__version__} | 1.24B params, {a.dtype} | "
          f"safetensors {t_st:.1f} s | orbax {t_ob:.1f} s |")


if __name__ == "__main__":
    main()
