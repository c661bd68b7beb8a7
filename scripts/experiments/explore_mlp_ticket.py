"""Experiment (not adopted): the batch-1 MLP (RMSNorm -> gate_up -> SwiGLU -> down ->
residual add) in one kernel, its two phases chained by atomic counters.

    y = residual + down(silu(gate(rms_norm(x))) * up(rms_norm(x)))

Why: each weight-streaming kernel on the H200 loses ~2-4 us to its start and drain
(docs/benchmarks.md, seventh session), and the MLP of a batch-1 Llama-3.1-8B layer is
three launches plus two RMSNorm fusions: 54.9 (gate_up, XLA) + 2.8 (norm) + 32.7 (down)
us per layer. Here the down programs start while the last gate_up programs drain.

How: one grid of P_gu + P_down programs. Each program takes a ticket (an atomic counter)
and the ticket, not program_id, says what it does, so tickets follow the order in which
programs actually started:
- ticket < P_gu: gate / up rows [t c, (t + 1) c) (two row blocks of the fused [2I, H]
  weight, the RMSNorm factored out of the dot as in fused_linear.stream_rows), rounded as
  the projection's output is, SwiGLU'd (rounded op by op like jax.nn.silu(g) * u), stored
  to the act buffer; then, after a CTA barrier, it increments the ready counter (release).
- otherwise: down rows [(t - P_gu) f, ...): waits until all P_gu gate_up programs have
  counted (acquire), then streams its rows against act and adds the residual.
A down program only waits on programs that took earlier tickets, so they have started and
never wait themselves: no deadlock, whatever the scheduler does. The interpreter runs
programs in order, so there the wait is already satisfied.

Outcome on the H200 (2026-11-21, jax 0.11.2, GPU time, two sweeps of 72 and 48 tilings;
raw docs/bench/2026-11-21_v7_mlp_ticket_sweep{1,2}.json): correct (0.6% from the XLA
reference, as the two-kernel path's 0.3%), no deadlock, but 91.6 us at best against 90.6
for the engine's path (XLA gate_up with its norm, then the fused down kernel) and 89.3 for
the XLA ops: the overlap is paid for by a gate_up stream ~3 us slower than XLA's GEMM.
The ticket + counter scheme is what a persistent batch-1 layer kernel would build on;
explore_layer_tail.py extends it to o_proj + the whole MLP, with a prefetch while waiting
(also not adopted).

    PYTHONPATH=.:scripts python scripts/experiments/explore_mlp_ticket.py   # GPU (CPU: interpret)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.fused_linear import ref_fused_linear, silu_mul_rounded, stream_rows


def ref_fused_mlp(x, w_gu, w_down, norm_w, residual, *, eps):
    """jnp reference (the unfused XLA ops). x, residual [..., H]; w_gu [2I, H] (gate rows
    then up rows); w_down [H, I]; norm_w [H]. -> [..., H]"""
    gu = ref_fused_linear(x, w_gu, prologue="rmsnorm", norm_w=norm_w, eps=eps)
    return ref_fused_linear(gu, w_down, prologue="silu_mul", residual=residual)


def default_blocks(H: int, I: int, dtype):
    """(rows per gate_up program c, its K tile, rows per down program f, its K tile,
    num_warps, num_stages), or None when the shape takes no tile."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return None  # the MMA stream (see fused_linear.default_mma_blocks)
    c = 32 if I % 32 == 0 else 16 if I % 16 == 0 else 0
    f = 32 if H % 32 == 0 else 16 if H % 16 == 0 else 0
    bd_gu = 256 if H % 256 == 0 else 128 if H % 128 == 0 else 0
    bd_d = 512 if I % 512 == 0 else 256 if I % 256 == 0 else 128 if I % 128 == 0 else 0
    return (c, bd_gu, f, bd_d, 4, 4) if c and f and bd_gu and bd_d else None


def _kernel(x_ref, wgu_ref, nw_ref, wd_ref, res_ref, _ctr_in, o_ref, act_ref, ctr_ref, *, H, I, c, bd_gu, f, bd_d,
            eps, interpret):
    # x_ref / res_ref [1, H]; wgu_ref [2I, H]; nw_ref [H]; wd_ref [H, I]; ctr: i32[2]
    # (ticket, gate_up programs done), aliased in and out; o_ref [1, H]; act_ref [1, I].
    f32 = jnp.float32
    dt = wgu_ref.dtype
    p_gu = I // c
    t = plt.atomic_add(ctr_ref, (jnp.int32(0),), jnp.int32(1))

    @pl.when(t < p_gu)
    def _gate_up():
        r0 = pl.multiple_of(t * c, c)
        g, u = stream_rows(x_ref, [(wgu_ref, pl.ds(r0, c)), (wgu_ref, pl.ds(I + r0, c))], nw_ref,
                           prologue="rmsnorm", K=H, block_d=bd_gu, eps=eps, mma=True)
        g, u = g.astype(dt).astype(f32), u.astype(dt).astype(f32)  # gate_up's output rounding
        act_ref[0, pl.ds(r0, c)] = silu_mul_rounded(g, u, dt).astype(dt)
        if not interpret:  # (the interpreter runs one program at a time, and has no barrier)
            plt.debug_barrier()  # every thread's act stores before the (release) count
        plt.atomic_add(ctr_ref, (jnp.int32(1),), jnp.int32(1))

    @pl.when(t >= p_gu)
    def _down():
        # acquire: poll the done counter until every gate_up program has counted
        # (index and addend derived from the carry: the interpreter's while-loop discharge
        # takes no constants in the body)
        lax.while_loop(lambda n: n < p_gu, lambda n: plt.atomic_add(ctr_ref, (n * 0 + 1,), n * 0),
                       plt.atomic_add(ctr_ref, (jnp.int32(1),), jnp.int32(0)))
        r0 = pl.multiple_of((t - p_gu) * f, f)
        (y,) = stream_rows(act_ref, [(wd_ref, pl.ds(r0, f))], None, prologue="none", K=I, block_d=bd_d, eps=eps,
                           mma=True)
        cols = pl.ds(r0, f)
        o_ref[0, cols] = (res_ref[0, cols].astype(f32) + y.astype(dt).astype(f32)).astype(dt)


@functools.partial(jax.jit, static_argnames=("eps", "blocks", "interpret"))
def fused_mlp_gpu(x, w_gu, w_down, norm_w, residual, *, eps=1e-6, blocks=None, interpret=False):
    """The kernel on one row: x, residual [1, H]. blocks: see default_blocks. -> [1, H]"""
    I2, H = w_gu.shape
    I = I2 // 2
    c, bd_gu, f, bd_d, warps, stages = blocks or default_blocks(H, I, w_gu.dtype)
    whole = pl.BlockSpec()
    out, _act, _ctr = pl.pallas_call(
        functools.partial(_kernel, H=H, I=I, c=c, bd_gu=bd_gu, f=f, bd_d=bd_d, eps=eps, interpret=interpret),
        grid=(I // c + H // f,),
        in_specs=[whole] * 6,
        out_specs=[whole] * 3,
        out_shape=[jax.ShapeDtypeStruct((1, H), w_gu.dtype), jax.ShapeDtypeStruct((1, I), w_gu.dtype),
                   jax.ShapeDtypeStruct((2,), jnp.int32)],
        input_output_aliases={5: 2},
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"fused_mlp_c{c}_f{f}",
    )(x, w_gu, norm_w, w_down, residual, jnp.zeros((2,), jnp.int32))
    return out


def main():
    import json
    import os

    from gpu_trace import device_times, time_tilings

    from kernels_pallas.fused_linear import fused_linear_gpu
    gpu = jax.default_backend() == "gpu"
    H, I = (4096, 14336) if gpu else (128, 256)
    keys = jax.random.split(jax.random.PRNGKey(H + I), 6)
    bf16, f32 = jnp.bfloat16, jnp.float32
    x = jax.random.normal(keys[0], (1, H), f32).astype(bf16)
    res = jax.random.normal(keys[1], (1, H), f32).astype(bf16)
    nw = (1 + 0.1 * jax.random.normal(keys[2], (H,), f32)).astype(bf16)
    n = 2 if gpu else 1
    sets = [(x, (0.02 * jax.random.normal(jax.random.fold_in(keys[3], i), (2 * I, H), f32)).astype(bf16),
             (0.02 * jax.random.normal(jax.random.fold_in(keys[4], i), (H, I), f32)).astype(bf16), nw, res)
            for i in range(n)]
    one = jax.jit(lambda x, a, b, n, r: fused_mlp_gpu(x, a, b, n, r, eps=1e-5, interpret=not gpu))
    ref = jax.jit(lambda x, a, b, n, r: ref_fused_mlp(x, a, b, n, r, eps=1e-5))
    two = jax.jit(lambda x, a, b, n, r: fused_linear_gpu(
        ref_fused_linear(x, a, prologue="rmsnorm", norm_w=n, eps=1e-5), b, None, None, r, prologue="silu_mul",
        eps=1e-5, interpret=not gpu))
    want = ref(*sets[0]).astype(f32)
    err = lambda y: float(jnp.max(jnp.abs(y.astype(f32) - want)) / jnp.max(jnp.abs(want)))  # noqa: E731
    row = dict(err_one=err(one(*sets[0])), err_two=err(two(*sets[0])))
    print(row, flush=True)
    if gpu:
        for label, fn in (("one_kernel", one), ("gate_up_xla_then_down_kernel", two), ("xla", ref)):
            t = device_times(fn, sets, reps=10)
            row[label] = (t["busy_us"], {k: round(v, 2) for k, v in t["kernels_us"].items()})
            print(label, row[label], flush=True)
        row["sweep"] = time_tilings(
            lambda bl: jax.jit(lambda x, a, b, n, r: fused_mlp_gpu(x, a, b, n, r, eps=1e-5, blocks=bl)),
            [(c, bdg, 32, bd, w, st) for c in (32, 64, 128) for bdg in (128, 256) for bd in (512, 1024)
             for w in (4, 8) for st in (3, 4)], sets)
        for b, us, _ in row["sweep"][:10]:
            print("  sweep", b, us, flush=True)
    json.dump(row, open(os.path.join(os.environ.get("OUT", "/tmp"), "explore_mlp_ticket.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
