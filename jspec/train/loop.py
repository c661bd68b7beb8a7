"""What every stage shares: parameters built from and saved through the checkpoint specs,
AdamW with warmup + cosine (optax), and the jitted training loop.

A stage supplies ``loss_fn(params, frozen, batch, key) -> (loss, metrics)``: ``params`` are
trained, ``frozen`` (the target, for drafters) is an argument rather than a closure so XLA
does not embed it as a constant, ``key`` drives per-step sampling (anchors, rollouts).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.checkpoint.target import set_path

# Projections writing into the residual stream: initialised smaller (GPT-2's 1/sqrt(2L)).
_RESIDUAL_OUT = ("o_proj", "down_proj")


def get_path(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def init_params(specs, key, *, num_layers: int, std: float = 0.02) -> dict:
    """f32 tree with a leaf per spec: norm gains 1, other weights N(0, std), residual
    output projections N(0, std / sqrt(2 num_layers))."""
    params: dict = {}
    for i, spec in enumerate(specs):
        if getattr(spec, "integer", False):
            raise ValueError(f"{spec.sources}: integer tensors (a reduced-vocab d2t) are not trained here")
        if spec.path[-1] == "weight" and len(spec.shape) == 1:
            arr = jnp.ones(spec.shape, jnp.float32)
        else:
            s = std / math.sqrt(2 * num_layers) if any(n in spec.path for n in _RESIDUAL_OUT) else std
            arr = s * jax.random.normal(jax.random.fold_in(key, i), spec.shape, jnp.float32)
        set_path(params, spec.path, arr)
    return params


def check_tree(params, specs):
    """Every spec'd leaf exists with its shape, and nothing else is in the tree."""
    want = {spec.path: spec.shape for spec in specs}
    got = {tuple(str(getattr(k, "key", k)) for k in kp): tuple(v.shape)
           for kp, v in jax.tree_util.tree_leaves_with_path(params)}
    if want != got:
        raise ValueError(f"parameter tree does not match the checkpoint spec: missing {sorted(set(want) - set(got))}, "
                         f"extra {sorted(set(got) - set(want))}, "
                         f"shapes {[(p, got[p], want[p]) for p in want if p in got and got[p] != want[p]]}")


def tensors_from_specs(params, specs, dtype) -> dict[str, jax.Array]:
    """Checkpoint tensors (HF names) from a tree: the loaders' concatenation, undone."""
    out = {}
    for spec in specs:
        arr = jnp.asarray(get_path(params, spec.path))
        rows = [s[0] for s in spec.source_shapes]
        arr = arr.reshape((sum(rows),) + tuple(spec.source_shapes[0][1:]))
        for name, part, shape in zip(spec.sources, jnp.split(arr, np.cumsum(rows)[:-1], axis=0), spec.source_shapes):
            out[name] = part.reshape(shape).astype(dtype)
    return out


def save_safetensors(tensors: dict, folder: str):
    from safetensors.flax import save_file

    os.makedirs(folder, exist_ok=True)
    fn = os.path.join(folder, "model.safetensors")
    save_file(tensors, fn, metadata={"format": "pt"})
    os.chmod(fn, 0o644)  # the writer creates it private; shipped weights must be readable by all


@dataclasses.dataclass(frozen=True)
class OptConfig:
    steps: int
    lr: float = 1e-3
    warmup_steps: int = 100
    end_lr_ratio: float = 0.1  # cosine decays to lr * end_lr_ratio at `steps`
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0

    def schedule(self):
        warmup = min(self.warmup_steps, max(self.steps - 1, 0))
        return optax.warmup_cosine_decay_schedule(
            0.0, self.lr, warmup, max(self.steps, warmup + 1), self.lr * self.end_lr_ratio)


def make_optimizer(oc: OptConfig, params):
    # No weight decay on norm gains (1-D leaves).
    decay = jax.tree.map(lambda a: a.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(oc.clip_norm),
        optax.adamw(oc.schedule(), b1=oc.b1, b2=oc.b2, weight_decay=oc.weight_decay, mask=decay),
    )


LossFn = Callable[..., tuple[jax.Array, dict]]


def fit(loss_fn: LossFn, params, frozen, batches: Iterator, oc: OptConfig, *, seed: int = 0,
        log_every: int = 50, log: Callable[[str], None] | None = print, name: str = "train",
        tokens_per_batch: int | None = None):
    """Train ``params`` for ``oc.steps`` steps; returns (params, history).

    history: one dict per logged step (step, loss, the stage's metrics, lr, seconds).
    """
    opt = make_optimizer(oc, params)
    sched = oc.schedule()

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, frozen, batch, key):
        p, opt_state = state
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, frozen, batch, key)
        updates, opt_state = opt.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), {"loss": loss, **metrics}

    state = (params, opt.init(params))
    base = jax.random.key(seed)
    history, t0, t_last, n_last = [], time.perf_counter(), time.perf_counter(), 0
    for i in range(oc.steps):
        state, metrics = step(state, frozen, next(batches), jax.random.fold_in(base, i))
        if (i + 1) % log_every == 0 or i + 1 == oc.steps or i == 0:
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            rec = {"step": i + 1, **m, "lr": float(sched(i)), "seconds": now - t0}
            history.append(rec)
            if log is not None:
                rate = (i + 1 - n_last) / max(now - t_last, 1e-9)
                extra = "".join(f" {k} {v:.4g}" for k, v in m.items() if k != "loss")
                tok = f", {rate * tokens_per_batch:,.0f} tok/s" if tokens_per_batch and i > 0 else ""
                log(f"[{name}] step {i + 1}/{oc.steps} loss {m['loss']:.4f}{extra} "
                    f"lr {rec['lr']:.2e} ({rate:.2f} step/s{tok}, {now - t0:.0f}s)")
            t_last, n_last = now, i + 1
    return state[0], history


def evaluate(loss_fn: LossFn, params, frozen, batches, *, seed: int = 0) -> dict:
    """Mean of the loss and metrics over ``batches`` (a finite iterable)."""
    @jax.jit
    def fn(p, f, b, k):
        loss, metrics = loss_fn(p, f, b, k)
        return {"loss": loss, **metrics}

    sums: dict = {}
    n = 0
    for i, b in enumerate(batches):
        for k, v in jax.device_get(fn(params, frozen, b, jax.random.fold_in(jax.random.key(seed), i))).items():
            sums[k] = sums.get(k, 0.0) + float(v)
        n += 1
    return {k: v / max(n, 1) for k, v in sums.items()}
