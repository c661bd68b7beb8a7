import json, os, sys
sys.path.insert(0, "scripts")
from bench_attention import gpu_time, timing_inputs
res = []
for Q in (1, 8):
    inputs = timing_inputs(B=1, Q=Q, ctx=512, S=16, distinct_pages_per_set=True)
    for tuning in ({}, {"kv_splits": 1}, {"kv_splits": 2}, {"kv_splits": 4}, {"kv_splits": 1, "block_kv": 128},
                   {"kv_splits": 2, "num_stages": 2}, {"kv_splits": 1, "num_stages": 3}):
        t = gpu_time(tuning, inputs, 10)
        res.append(dict(Q=Q, tuning=str(tuning), us=t["busy_us"], kernels=t["kernels_us"]))
        print(Q, tuning, round(t["busy_us"], 2), {k: round(v, 2) for k, v in t["kernels_us"].items()}, flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "attn_ctx512_b1.json"), "w"), indent=1)
