"""One engine over several hosts: JAX's multi-controller runtime, node 0 leading.

Every host runs the same command with its own ``node_rank`` (vLLM's ``--nnodes``,
``--node-rank``, ``--master-addr``, ``--master-port``). ``initialize`` joins the hosts
through ``jax.distributed`` (the coordinator at master_addr:master_port on node 0), after
which ``jax.devices()`` lists every host's devices and the tensor-parallel mesh
(jspec/parallel/mesh.py) spans them. Each host builds the engine as one would alone (its
own shards of the weights and of the KV cache, from the same checkpoint). In a
multi-controller program every process must launch the same jitted calls on the same
inputs; only node 0 schedules (its requests, its server), so it sends each call it makes
to the others over ``Channel`` (a socket beside the coordinator, master_port + 1):
the jitted function's name, its static arguments and its host arrays
(jspec/engine/mirror.py), and the followers make the same call on their devices.

Failure: a follower whose leader goes away (its process ended, the host died) reads the
end of the socket and raises ``LeaderGone``; a leader whose follower went away fails to
send and raises ``FollowerGone``; a host that dies inside a collective is reported by
jax.distributed's heartbeat (``HEARTBEAT_S``) to the others, which then stop with its
error rather than wait.
"""

from __future__ import annotations

import logging
import pickle
import socket
import struct
import time

import jax
import numpy as np

logger = logging.getLogger("jspec.engine")

HEARTBEAT_S = 30  # jax.distributed's: a host silent this long is reported dead to the others
CONNECT_S = 600  # how long a follower waits for the leader's socket (the leader may still be loading)
_AUTH = b"jspec-multihost-v1"  # first bytes each side sends: a stray connection is refused


class LeaderGone(RuntimeError):
    pass


class FollowerGone(RuntimeError):
    pass


class NodeFailed(RuntimeError):
    pass


def check_step_failure(e: BaseException):
    """A step that failed on the device over several nodes: NodeFailed naming that (a
    collective whose peer is gone fails so: "Gloo all-reduce failed: Connection reset")."""
    if jax.process_count() > 1 and isinstance(e, jax.errors.JaxRuntimeError):
        raise NodeFailed(f"a step of this engine over {jax.process_count()} nodes failed on the device; a node may "
                         f"have gone away (its log says why): {e}") from e


def check_nodes(nnodes: int, node_rank: int, master_port: int):
    """ValueError naming the argument unless the node arguments fit together."""
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be an int >= 1, got {nnodes!r}")
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be an int in [0, nnodes={nnodes}), got {node_rank!r}")
    if not isinstance(master_port, int) or not 0 < master_port < 65535:
        raise ValueError(f"master_port must be a TCP port below 65535 (the channel takes the next), "
                         f"got {master_port!r}")


def initialize(nnodes: int, node_rank: int, master_addr: str, master_port: int):
    """Join the ``nnodes`` hosts through jax.distributed (node 0 runs its coordinator), once
    per process; before anything starts JAX's backend."""
    check_nodes(nnodes, node_rank, master_port)
    if nnodes == 1:
        return
    from jax._src import distributed

    if distributed.global_state.client is not None:  # joined already (a second engine in this process)
        if jax.process_count() != nnodes or jax.process_index() != node_rank:
            raise ValueError(f"this process joined {jax.process_count()} nodes as node {jax.process_index()}; "
                             f"nnodes={nnodes}, node_rank={node_rank} disagree")
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the CPU backend's only cross-process one
    try:
        jax.distributed.initialize(f"{master_addr}:{master_port}", num_processes=nnodes, process_id=node_rank,
                                   heartbeat_timeout_seconds=HEARTBEAT_S)
    except RuntimeError as e:
        raise RuntimeError(f"nnodes={nnodes}: joining the nodes at {master_addr}:{master_port} as node {node_rank} "
                           f"failed (it must happen before this process uses JAX): {e}") from None
    logger.info("node %d of %d: %d local devices of %d", node_rank, nnodes, jax.local_device_count(),
                jax.device_count())


def agree_min(n: int) -> int:
    """The least of every process's ``n`` (a collective: each process calls it at the same
    point): the KV pool's pages sized from each host's free memory, so that every host
    allocates the same shapes."""
    if jax.process_count() == 1:
        return n
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.asarray([n], np.int64))))


def host_copy(x):
    """A numpy copy of a step output: replicated on every device of a multi-host mesh, this
    host's copy (np.asarray of the global array would need the others' buffers)."""
    if isinstance(x, jax.Array) and jax.process_count() > 1 and not x.is_fully_addressable:
        if not x.sharding.is_fully_replicated:
            raise ValueError(f"a step output {x.shape} is split over hosts ({x.sharding}); it must be replicated")
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


class Channel:
    """Node 0's messages to the other nodes: length-prefixed pickles over one TCP socket per
    follower (trusted hosts of one job, as the coordinator is)."""

    def __init__(self, socks: list, leader: bool):
        self.socks, self.leader = socks, leader

    @classmethod
    def lead(cls, nnodes: int, master_addr: str, master_port: int, timeout: float = CONNECT_S) -> Channel:
        """Node 0: accept the nnodes - 1 followers (each says its rank) on master_port + 1."""
        srv = socket.create_server(("", master_port + 1), reuse_port=False)
        srv.settimeout(timeout)
        socks: dict[int, socket.socket] = {}
        try:
            while len(socks) < nnodes - 1:
                try:
                    s, _ = srv.accept()
                except TimeoutError:
                    raise FollowerGone(f"nodes {sorted(set(range(1, nnodes)) - set(socks))} did not connect to "
                                       f"node 0's channel (port {master_port + 1}) within {timeout:.0f} s") from None
                s.settimeout(timeout)
                hello = _recv_exact(s, len(_AUTH) + 4)
                if hello[: len(_AUTH)] != _AUTH:
                    s.close()
                    continue
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                socks[struct.unpack("<i", hello[len(_AUTH):])[0]] = s
        finally:
            srv.close()
        return cls([socks[r] for r in sorted(socks)], leader=True)

    @classmethod
    def follow(cls, node_rank: int, master_addr: str, master_port: int, timeout: float = CONNECT_S) -> Channel:
        """A follower: connect to node 0's channel, retrying while node 0 starts."""
        t0 = time.monotonic()
        while True:
            try:
                s = socket.create_connection((master_addr, master_port + 1), timeout=10)
                break
            except OSError as e:
                if time.monotonic() - t0 > timeout:
                    raise LeaderGone(f"node {node_rank}: node 0's channel at {master_addr}:{master_port + 1} did "
                                     f"not answer within {timeout:.0f} s ({e})") from None
                time.sleep(0.2)
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(_AUTH + struct.pack("<i", node_rank))
        return cls([s], leader=False)

    def send(self, msg):
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        frame = struct.pack("<q", len(data)) + data
        for i, s in enumerate(self.socks):
            try:
                s.sendall(frame)
            except OSError as e:
                raise FollowerGone(f"node {i + 1} went away ({e}): the engine cannot run without it") from None

    def recv(self):
        s = self.socks[0]
        try:
            n = struct.unpack("<q", _recv_exact(s, 8))[0]
            return pickle.loads(_recv_exact(s, n))
        except (OSError, EOFError) as e:
            raise LeaderGone(f"node 0 went away ({e}): this node stops following") from None

    def close(self):
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass
        self.socks = []


def _recv_exact(s, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)
