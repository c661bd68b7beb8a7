"""One node of tests/parallel/test_multihost.py's engines over two processes (run as a script).

    python -m tests.helpers.multihost_node RANK PORT FOLDER CASES_JSON OUT_JSON

Each case ({"spec": speculative_config or None, "prompts": [...], "die": DIE}) is one
jspec.LLM at tensor_parallel_size 4 over the 2 x 2 devices of the two processes: node 0
generates greedily and closes it, node 1 follows; then each lets it go and reports the
arrays still alive (node 0 in its results after the case's outputs). DIE "follower": node 1 exits after
5 calls; "leader": node 0 exits once its first step was sent. Node 0 writes its outputs
(or the error it raised, with the seconds it took) to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time


def live_arrays() -> int:
    import gc

    import jax

    gc.collect()
    return len(jax.live_arrays())


def main():
    rank, port, folder, cases, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), \
        sys.argv[5]
    import jspec
    from tests.helpers import buckets

    buckets.from_env()  # the parent test's shape buckets
    kw = dict(max_num_seqs=2, max_model_len=48, page_size=64, max_prefill_chunk=16, max_num_batched_tokens=32)
    results = []
    for case in cases:
        llm = jspec.LLM(folder, speculative_config=case["spec"], tensor_parallel_size=4, nnodes=2, node_rank=rank,
                        master_port=port, **kw)
        runner = llm.engine.runner
        if case.get("die") == ("follower" if rank else "leader"):
            real, calls = runner._invoke_here, [0]

            def dying(*a, real=real, calls=calls):
                calls[0] += 1
                if calls[0] > 5:
                    os._exit(3)
                return real(*a)

            runner._invoke_here = dying
        if rank:
            print(f"node 1 followed {llm.follow()} calls", flush=True)
            del llm, runner
            print(f"node 1 arrays left {live_arrays()}", flush=True)
            continue
        t = time.monotonic()
        sp = jspec.SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
        try:
            results.append([o.token_ids for o in llm.generate(case["prompts"], sp)])
        except Exception as e:  # the error a user sees, for the test to read
            results.append({"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t})
            with open(out, "w") as f:
                json.dump(results, f)
            raise
        llm.close()
        del llm, runner
        results.append({"arrays_left": live_arrays()})  # a closed engine let go holds no device memory
    if not rank:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
