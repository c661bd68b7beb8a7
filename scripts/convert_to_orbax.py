"""Convert a HF target folder into an orbax copy that jspec's loader restores.

    python scripts/convert_to_orbax.py HF_DIR OUT_DIR [--dtype bfloat16]

OUT_DIR gets config.json, the tokenizer / generation files, and orbax_params/; it holds no
safetensors, and jspec.LLM(model=OUT_DIR) restores from orbax.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

from jspec.checkpoint.target import load_target, save_orbax

KEEP = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "tokenizer.model", "chat_template.jinja")


def convert(src: str, dst: str, dtype: str = "bfloat16") -> float:
    t0 = time.perf_counter()
    _, params = load_target(src, dtype)
    os.makedirs(dst, exist_ok=True)
    for name in KEEP:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    save_orbax(params, dst)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    print(f"converted in {convert(a.src, a.dst, a.dtype):.1f}s -> {a.dst}")


if __name__ == "__main__":
    main()
