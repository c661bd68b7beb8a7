"""After a step that failed on the device: the engine's buffers back, its requests recomputed.

A jitted step donates the device state (the KV caches, the drafter's cache, the drafts'
probabilities: ``EngineState``). When the step fails on the device (out of memory, a driver
error) those buffers are gone (donated) or poisoned (the failed call's outputs), and every
later step fails on them: the engine would be dead for every request, not only for the
failed step's (seen on an H200: after an out-of-memory step the engine held 0.04 GB).
``restore_after_failure`` puts zeroed buffers of the same shapes and shardings in their
place, preempts every running sequence (recomputed from its tokens, as any preempted one)
and forgets the prefix cache, whose pages' contents are gone.
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp


def _lost(tree) -> bool:
    """True when a buffer of ``tree`` was donated to a call, or made by a call that failed."""
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    if any(x.is_deleted() for x in leaves):
        return True
    try:
        jax.block_until_ready(leaves)
    except jax.errors.JaxRuntimeError:
        return True
    return False


def restore_after_failure(runner, scheduler) -> int | None:
    """After ``LLMEngine.step`` raised: if the runner's device state (``EngineState``,
    donated to every step) was lost, a zeroed one in its place, every running sequence
    preempted and the prefix cache emptied; the number preempted then. None (nothing
    changed) when the state is intact (the step failed on the host)."""
    if not _lost(runner.state):
        return None
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), runner.state)
    runner.state = None  # the old buffers go back before the new ones are made
    gc.collect()
    runner.state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), spec)
    running = list(scheduler.running)
    for seq in reversed(running):  # each goes to the waiting queue's front: their order kept
        scheduler.preempt(seq)
    scheduler.blocks.forget_cached_pages()
    return len(running)
