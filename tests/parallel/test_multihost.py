"""Issue 59 must-show: one engine over several hosts (jax.distributed's multi-controller
runtime; jspec/parallel/multihost.py, jspec/engine/mirror.py), on this machine.

Two processes of 2 virtual CPU devices each, joined through jax.distributed on localhost
(gloo collectives), run one engine at tensor_parallel_size 4: node 0 schedules and
generates, node 1 follows its calls (tests/helpers/multihost_node.py). Their greedy outputs
equal one process's at tp 1, plain (async scheduling: chained calls refer to the call
before) and with EAGLE3 (its verification and drafting sharded over both processes). A
node that dies gives the other an error within jax.distributed's heartbeat, not a hang.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import buckets
from tests.helpers import parallel as h

PROMPTS = h.prompts(3, 4, 15, seed=0)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the coordinator and node 0's channel)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def run_nodes(tmp_path, cases, timeout=300):
    """(node 0's results, [exit codes], [outputs]) of the two processes."""
    folder, _ = h.target("llama")
    out = str(tmp_path / "out.json")
    # 2 devices a process (the pytest process's 8 are its own XLA_FLAGS)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": REPO, **buckets.child_env()}
    port = free_port_pair()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.multihost_node", str(r), str(port), folder,
                               json.dumps(cases), out], env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    results = json.load(open(out)) if os.path.exists(out) else None
    return results, [p.returncode for p in procs], logs


def test_two_nodes_give_one_devices_greedy_outputs(tmp_path):
    spec = h.spec_config("llama", "eagle3", num_speculative_tokens=2)
    results, codes, logs = run_nodes(tmp_path, [{"spec": None, "prompts": PROMPTS},
                                                {"spec": spec, "prompts": PROMPTS}])
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    want = h.generate(h.llm("llama", None, 1), PROMPTS, 16)
    assert len({tuple(o) for o in want}) == len(want)  # not one repeated answer
    assert results[0] == want, "two nodes at tp 4, plain: greedy outputs differ from one device's"
    assert results[2] == want, "two nodes at tp 4, EAGLE3: greedy outputs differ from one device's"
    assert "node 1 followed" in logs[1]
    # each engine, closed and let go, left nothing on the devices of either node (the next one has them all)
    assert results[1] == results[3] == {"arrays_left": 0}, results
    assert logs[1].count("node 1 arrays left 0") == 2, logs[1][-3000:]


@pytest.mark.parametrize("who", ["follower", "leader"])
def test_a_node_that_dies_stops_the_other_with_an_error(tmp_path, who):
    results, codes, logs = run_nodes(tmp_path, [{"spec": None, "prompts": PROMPTS, "die": who}], timeout=150)
    other = logs[0] if who == "follower" else logs[1]
    assert codes[1 if who == "follower" else 0] == 3  # the one that died
    assert codes[0 if who == "follower" else 1] != 0, other[-3000:]  # the other did not carry on as if whole
    if who == "follower":  # node 0's generate raised, naming the failure
        assert results[0]["error"].startswith("NodeFailed: a step of this engine over 2 nodes failed"), results
        assert results[0]["seconds"] < 100, results
    else:  # node 1 stopped following, saying why
        assert "LeaderGone: node 0 went away" in other, other[-3000:]


def test_the_server_runs_on_node_0_with_node_1_following(monkeypatch):
    """`python -m jspec.serve --nnodes 2` on both nodes: node 0 answers (greedy tokens equal to
    one device's), node 1 serves nothing and returns once node 0 stops."""
    import httpx

    from tests.helpers.serve import start_server

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # the servers' devices
    folder, _ = h.target("llama")
    port = free_port_pair()
    common = ["--model", folder, "--tensor-parallel-size", "4", "--nnodes", "2", "--master-port", str(port),
              "--max-num-seqs", "2", "--max-model-len", "48", "--page-size", "64", "--max-prefill-chunk", "16",
              "--max-num-batched-tokens", "32"]
    follower = start_server(["--node-rank", "1"], wait=False, engine_args=common)
    leader = start_server([], wait=False, engine_args=common)
    try:
        leader.wait_healthy(240)
        got = []
        for p in PROMPTS:
            r = httpx.post(leader.base_url + "/v1/completions", timeout=120, json={
                "model": folder, "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
        assert got == h.generate(h.llm("llama", None, 1), PROMPTS, 16)
        assert leader.stop() == 0, leader.log()[-3000:]
        assert follower.proc.wait(60) == 0, follower.log()[-3000:]
        assert "steps followed" in follower.log()
    finally:
        for s in (leader, follower):
            if s.proc.poll() is None:
                s.proc.kill()
