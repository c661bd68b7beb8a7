"""The runner's jitted calls repeated on the other hosts of a multi-host engine.

Node 0 schedules; each call it makes (``FlatRunner._invoke``: ``_step``, ``_fwd`` or
``_tail``) goes to the followers as (call id, function name, static arguments, arguments),
each argument encoded as what the follower holds of it:
  - the runner's own device trees (params, the drafter's, the state, the synthetic rates)
    by name: each host holds its shards of them;
  - host arrays (the packed step input) as they are;
  - an output of an earlier call (a chained step's ``prev``, a split step's forward) as
    (call id, index into the output tuple): each host keeps its recent outputs;
  - the zeros an unchained fed-back call passes as ``prev``, by their key.
The followers then make the same call in the same order, so the collectives of every
host's programs meet. Warmup runs on every host alike before the channel opens.
"""

from __future__ import annotations

import atexit
import collections
import weakref

import numpy as np

from jspec.parallel import multihost

KEEP = 16  # calls whose outputs stay referable (a chain reaches back one or two)
CLOSED = "closed"  # FlatRunner.leader once node 0 closed: no call may run any more


class Leader:
    """Node 0's side: encodes each call and sends it before running it."""

    def __init__(self, channel):
        self.channel = channel
        self.next_id = 0
        self._refs: dict[int, tuple] = {}  # id(object) -> (call id, index or None)
        self._recent: collections.deque = collections.deque()  # (call id, out): alive while referable

    def before(self, runner, name: str, args, kw) -> int:
        cid, self.next_id = self.next_id, self.next_id + 1
        # the packed input's layout travels itself: its id is this runner's numbering
        kw = {**kw, "layout": runner._layouts[kw["layout"]]}
        self.channel.send(("call", cid, name, [self._encode(runner, a) for a in args], kw))
        return cid

    def after(self, cid: int, out):
        self._recent.append((cid, out))
        self._refs[id(out)] = (cid, None)
        if isinstance(out, tuple):
            for i, o in enumerate(out):
                self._refs[id(o)] = (cid, i)
        while len(self._recent) > KEEP:
            old_cid, old = self._recent.popleft()
            for o in (old, *(old if isinstance(old, tuple) else ())):
                if self._refs.get(id(o), (None,))[0] == old_cid:
                    del self._refs[id(o)]

    def stop(self):
        try:
            self.channel.send(("stop",))
        finally:
            self.channel.close()

    def _encode(self, runner, a):
        if a is None or isinstance(a, np.ndarray):
            return ("host", a)
        for field in ("params", "dparams", "state", "synthetic_rates"):
            if a is getattr(runner, field):
                return ("own", field)
        if id(a) in self._refs:
            return ("out", *self._refs[id(a)])
        for key, z in runner._no_prev.items():
            if a is z:
                return ("no_prev", key)
        raise TypeError(f"a multi-host step argument of type {type(a).__name__} has no encoding for the followers")


def follow(runner, channel) -> int:
    """A follower's loop: make each call node 0 sends, until it says stop. -> calls made."""
    outs: collections.OrderedDict = collections.OrderedDict()

    def decode(enc):
        kind, *rest = enc
        if kind == "host":
            return rest[0]
        if kind == "own":
            return getattr(runner, rest[0])
        if kind == "out":
            out = outs[rest[0]]
            return out if rest[1] is None else out[rest[1]]
        return runner.no_prev(rest[0])

    n = 0
    while True:
        msg = channel.recv()
        if msg[0] == "stop":
            channel.close()
            return n
        _, cid, name, enc_args, kw = msg
        kw["layout"] = runner._layout_id(kw["layout"])
        runner.state, out = runner._invoke_here(name, [decode(e) for e in enc_args], kw)
        outs[cid] = out
        while len(outs) > KEEP:
            outs.popitem(last=False)
        n += 1


def lead(runner, c, close):
    """Node 0 (EngineConfig ``c``), at its first step: the other nodes connected, each call
    sent to them from now on; ``close`` (the engine's bound method) to run at exit if the
    engine still lives then. Held weakly: atexit holding the engine kept its weights and KV
    pool on the device after the user let it go (a second engine in the process then ran
    out of memory: a 70B at tp 2, a process per GPU, 2026-11-30)."""
    if c.node_rank:
        raise RuntimeError(f"node_rank={c.node_rank} follows node 0, which schedules: call follow() here "
                           f"(LLM.follow(); the server does on its own)")
    runner.leader = Leader(multihost.Channel.lead(c.nnodes, c.master_addr, c.master_port))
    ref = weakref.WeakMethod(close)
    atexit.register(lambda: (m := ref()) is not None and m())


def follow_node(runner, c) -> int:
    if not c.node_rank:
        raise RuntimeError("node 0 schedules: follow() is for the nodes of node_rank >= 1")
    return follow(runner, multihost.Channel.follow(c.node_rank, c.master_addr, c.master_port))


def close_node(runner, c):
    if c.nnodes > 1 and not c.node_rank and runner.leader is not CLOSED:
        if runner.leader is None:  # never stepped: the others still wait to connect
            runner.leader = Leader(multihost.Channel.lead(c.nnodes, c.master_addr, c.master_port))
        leader, runner.leader = runner.leader, CLOSED
        leader.stop()
