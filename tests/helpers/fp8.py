"""FP8 checkpoints of tiny HF models, in each format jspec reads, each beside a plain folder of
its dequantized weights (float32) that transformers loads as an ordinary model.

The quantizer is torch's (independent of jspec/quantization.py): the decoder layers'
projections (q/k/v/o, gate/up/down, each expert's) to float8_e4m3fn with scales per output
channel, per tensor or per block (partial blocks at the edges), the embedding, the lm_head
and a mixture-of-experts router left as they are (as vLLM's models read them).
"""

from __future__ import annotations

import json
import os
import re

import torch

FP8_MAX = 448.0
# The projections a checkpoint quantizes (HF names); the router "mlp.gate" and lm_head are not.
PROJECTION = re.compile(r".*\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight$")

# the formats write_fp8 writes
FORMATS = {
    "ct_channel": "compressed-tensors, per output channel, dynamic activations",
    "ct_tensor": "compressed-tensors, per tensor, static activations (input_scale tensors present)",
    "ct_block": "compressed-tensors, per block",
    "fp8_block": "quant_method fp8 (DeepSeek / Qwen3-FP8 style), weight_scale_inv per block",
}


def quant_config(fmt: str, block=(128, 128)) -> dict:
    if fmt == "fp8_block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block), "modules_to_not_convert": None}
    strategy = fmt.removeprefix("ct_")
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
               "group_size": None, "actorder": None, "observer": "minmax", "observer_kwargs": {},
               "block_structure": list(block) if strategy == "block" else None}
    acts = {"num_bits": 8, "type": "float", "strategy": "tensor" if strategy == "tensor" else "token",
            "symmetric": True, "dynamic": strategy != "tensor", "group_size": None, "actorder": None,
            "observer": None if strategy != "tensor" else "minmax", "observer_kwargs": {}, "block_structure": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "quantization_status": "compressed",
            "global_compression_ratio": None, "sparsity_config": {}, "version": "0.10.2"}


def per_token_fp8(h):
    """The W8A8 activations' maths in numpy (an independent reference of
    kernels_pallas.fused_linear.quantize_rows): each row of h (float32 [..., K]) as e4m3 values
    with one scale max|h| * (1 / 448) (floor 1e-12), the values h * (1 / scale) clipped and
    rounded by ml_dtypes; the scale and its reciprocal in float32, as specified (bf16 inputs
    put many h / scale on a rounding tie). -> (values as float64, scales float64 [..., 1])."""
    import ml_dtypes
    import numpy as np

    h = np.asarray(h, np.float32)
    s = np.maximum(np.abs(h).max(axis=-1, keepdims=True), np.float32(1e-12)) * np.float32(1 / FP8_MAX)
    q = np.clip(h * (np.float32(1) / s), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float64), s.astype(np.float64)


# compressed-tensors' static per-tensor FP8 KV-cache scheme (llm-compressor's)
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def with_kv_scales(folder: str, out: str, scales: list[tuple[float, float]]) -> str:
    """A copy at ``out`` of the compressed-tensors checkpoint ``folder`` that declares FP8
    KV-cache scales: kv_cache_scheme, and per layer ``self_attn.k_scale`` (a scalar) and
    ``self_attn.v_scale`` (shape [1]: files hold either) from ``scales`` [(k, v)] per layer."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    for i, (k, v) in enumerate(scales):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v])
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"]["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def quantize(w: torch.Tensor, strategy: str, block=(128, 128)):
    """(float8_e4m3fn weight, scale as the checkpoint stores it, dequantized float32 weight)."""
    w = w.float()
    if strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        full = scale
    elif strategy == "tensor":
        scale = (w.abs().amax() / FP8_MAX).reshape(1)
        full = scale
    else:
        b0, b1 = block
        r, c = w.shape
        R, C = -(-r // b0), -(-c // b1)
        padded = torch.zeros(R * b0, C * b1)
        padded[:r, :c] = w.abs()
        scale = padded.reshape(R, b0, C, b1).amax(dim=(1, 3)) / FP8_MAX
        full = scale.repeat_interleave(b0, 0)[:r].repeat_interleave(b1, 1)[:, :c]
    full = torch.where(full > 0, full, torch.ones_like(full))
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def write_fp8(model, folder: str, fmt: str, block=(128, 128)):
    """``model`` (a transformers causal LM) saved to ``folder`` in FP8 format ``fmt`` (FORMATS)
    and its dequantized weights to ``folder + "_deq"`` (both under the checkpoint's tensor
    names, as save_pretrained writes them); returns (fp8 folder, dequantized folder, the
    dequantized folder loaded by transformers)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    strategy = "block" if fmt.endswith("block") else fmt.removeprefix("ct_")
    suffix = "weight_scale_inv" if fmt == "fp8_block" else "weight_scale"
    src = folder + "_src"
    model.save_pretrained(src)
    out, deq = {}, {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if PROJECTION.match(name):
            q, scale, d = quantize(t, strategy, block)
            out[name] = q
            out[name.removesuffix("weight") + suffix] = scale
            if fmt == "ct_tensor":  # static activations: a scale jspec's weight-only path never reads
                out[name.removesuffix("weight") + "input_scale"] = torch.ones(1)
            deq[name] = d
        else:
            out[name] = deq[name] = t
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    for path, tensors, qc in ((folder, out, quant_config(fmt, block)), (folder + "_deq", deq, None)):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**cfg, "quantization_config": qc} if qc else cfg, f, indent=1)
        save_file(tensors, os.path.join(path, "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(folder + "_deq", dtype=torch.float32)
    return folder, folder + "_deq", ref.eval()
