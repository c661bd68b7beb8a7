"""Target-model parameters from a HF checkpoint folder or an orbax copy of one.

``target_param_spec`` is the single map from our parameter tree to HF tensor names; the
loader, the orbax restore and the error messages all come from it.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.dummy import check_load_format, dummy_params
from jspec.checkpoint.safetensors_io import CheckpointError, SafetensorsReader
from jspec.config import ModelConfig, load_model_config

ORBAX_DIR = "orbax_params"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    path: tuple[str, ...]  # our tree path
    shape: tuple[int, ...]
    sources: tuple[str, ...]  # HF tensor names, concatenated along axis 0
    source_shapes: tuple[tuple[int, ...], ...]


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported (choose from {sorted(DTYPES)})")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def target_param_spec(c: ModelConfig) -> list[ParamSpec]:
    H, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    specs = []

    def add(path, sources, source_shapes):
        shape = (sum(s[0] for s in source_shapes),) + tuple(source_shapes[0][1:])
        specs.append(ParamSpec(tuple(path), shape, tuple(sources), tuple(source_shapes)))

    add(("embed_tokens", "embedding"), ["model.embed_tokens.weight"], [(c.vocab_size, H)])
    for i in range(c.num_layers):
        p, L = f"model.layers.{i}", f"layers_{i}"
        add((L, "input_layernorm", "weight"), [f"{p}.input_layernorm.weight"], [(H,)])
        add((L, "post_attention_layernorm", "weight"), [f"{p}.post_attention_layernorm.weight"], [(H,)])
        qkv = [f"{p}.self_attn.{n}_proj" for n in "qkv"]
        qkv_shapes = [(c.q_size,), (c.kv_size,), (c.kv_size,)]
        add((L, "attn", "qkv_proj", "weight"), [n + ".weight" for n in qkv], [s + (H,) for s in qkv_shapes])
        if c.attention_bias:
            add((L, "attn", "qkv_proj", "bias"), [n + ".bias" for n in qkv], qkv_shapes)
            add((L, "attn", "o_proj", "bias"), [f"{p}.self_attn.o_proj.bias"], [(H,)])
        add((L, "attn", "o_proj", "weight"), [f"{p}.self_attn.o_proj.weight"], [(H, c.q_size)])
        if c.qk_norm:
            add((L, "attn", "q_norm", "weight"), [f"{p}.self_attn.q_norm.weight"], [(D,)])
            add((L, "attn", "k_norm", "weight"), [f"{p}.self_attn.k_norm.weight"], [(D,)])
        gu = [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"]
        add((L, "mlp", "gate_up_proj", "weight"), [n + ".weight" for n in gu], [(I, H), (I, H)])
        add((L, "mlp", "down_proj", "weight"), [f"{p}.mlp.down_proj.weight"], [(H, I)])
        if c.mlp_bias:
            add((L, "mlp", "gate_up_proj", "bias"), [n + ".bias" for n in gu], [(I,), (I,)])
            add((L, "mlp", "down_proj", "bias"), [f"{p}.mlp.down_proj.bias"], [(H,)])
    add(("norm", "weight"), ["model.norm.weight"], [(H,)])
    if not c.tie_word_embeddings:
        add(("lm_head",), ["lm_head.weight"], [(c.vocab_size, H)])
    return specs


def set_path(tree: dict, path: tuple[str, ...], value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def load_params_from_safetensors(folder, cfg: ModelConfig, specs, dtype, sharding=None, progress=None):
    """Stream tensors one by one into a param pytree of ``dtype`` on ``sharding``'s devices."""
    reader = SafetensorsReader(folder)
    # Check every name and shape up front, so a bad checkpoint fails before any transfer.
    for spec in specs:
        for name, want in zip(spec.sources, spec.source_shapes):
            if name not in reader:
                raise CheckpointError(f"checkpoint {folder!r} is missing tensor {name!r}")
            got = reader.shape(name)
            if got != want:
                raise CheckpointError(
                    f"tensor {name!r} in {folder!r} has shape {list(got)}, expected {list(want)} from config.json"
                )
    total = reader.nbytes()
    if progress is None:
        progress = total > (1 << 30)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(s.sources) for s in specs), desc="loading weights", unit="tensor")
    params: dict = {}
    for spec in specs:
        parts = []
        for name in spec.sources:
            parts.append(reader.get(name).astype(dtype))
            if bar is not None:
                bar.update(1)
        arr = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
        if sharding is not None:
            arr = jax.device_put(arr, sharding)
        set_path(params, spec.path, arr)
        del parts
    if bar is not None:
        bar.close()
    reader.close()
    return params


def save_orbax(params, folder: str) -> str:
    """Write ``params`` as an orbax checkpoint under ``folder/orbax_params``."""
    import orbax.checkpoint as ocp

    out = os.path.abspath(os.path.join(folder, ORBAX_DIR))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out, params, force=True)
    return out


def restore_orbax(folder, specs, dtype, sharding=None):
    import orbax.checkpoint as ocp

    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target: dict = {}
    for spec in specs:
        set_path(target, spec.path, jax.ShapeDtypeStruct(spec.shape, dtype, sharding=sharding))
    path = os.path.abspath(os.path.join(folder, ORBAX_DIR))
    with ocp.StandardCheckpointer() as ckptr:
        try:
            return ckptr.restore(path, target)
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"orbax checkpoint {path!r} does not match config.json: {e}") from None


def load_target(path, dtype="float32", sharding=None, progress=None, load_format="auto"):
    """Load (ModelConfig, params) from a HF folder, or from its orbax copy when present.

    A folder holding ``orbax_params/`` (written by scripts/convert_to_orbax.py) restores
    from orbax; otherwise the safetensors are streamed. ``load_format="dummy"`` reads
    config.json alone and draws random weights (jspec/checkpoint/dummy.py).
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a directory")
    cfg = load_model_config(path)
    dt = resolve_dtype(dtype)
    specs = target_param_spec(cfg)
    if check_load_format(load_format) == "dummy":
        params = dummy_params(specs, dt, seed=0, sharding=sharding)
    elif os.path.isdir(os.path.join(path, ORBAX_DIR)):
        params = restore_orbax(path, specs, dt, sharding)
    else:
        params = load_params_from_safetensors(path, cfg, specs, dt, sharding, progress)
    jax.block_until_ready(params)
    return cfg, params


def flat_params(params) -> dict[str, np.ndarray]:
    """{'a/b/c': array} view of a param tree (tests, tools)."""
    out = {}
    for kp, v in jax.tree_util.tree_leaves_with_path(params):
        out["/".join(str(getattr(k, "key", k)) for k in kp)] = v
    return out
