"""GPU time of jitted calls from the profiler's kernel records (CUPTI), not wall clock.

Why: at batch 1 an attention call or a rejection-sampling kernel is 10-100 us of GPU work,
while the host needs ~3-5 us to launch each XLA op; wall-clock timing then measures the
host as much as the GPU, and runs disagreed by +-20%. The profiler records each kernel's
start and end on the device, so the sum of a call's kernel durations is what the call
adds to a GPU step whatever the host does.

traced_events(fn, arg_sets, reps) -> the GPU events themselves (scripts/step_profile.py).
host_times(fn, reps) -> where the host's time goes in back-to-back calls (its profiler planes).
device_times(fn, arg_sets, reps) -> {"busy_us": mean GPU busy time per call (every kernel,
memset and copy the call ran), "union_us": the same as the union of their intervals (below
busy_us only where kernels overlap, as with PDL), "kernels_us": {kernel name: mean us per call}}.
time_tilings(make_fn, tilings, arg_sets, ...) -> the same for each tiling of a kernel, best
first (the tile sweeps of scripts/bench_linear.py).
"""

from __future__ import annotations

import collections
import glob
import tempfile

import jax
from jax.profiler import ProfileData


def _device_events(path):
    """(name, duration_ns, start_ns) of every event on the GPU streams of a trace."""
    pd = ProfileData.from_file(path)
    out = []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        # Stream lines hold the kernels; derived lines ("XLA Ops", "XLA Modules") would
        # count them twice.
        for line in plane.lines:
            if line.name.startswith("Stream"):
                out += [(ev.name, ev.duration_ns, ev.start_ns) for ev in line.events]
    return out


def _profiled(run) -> str:
    """The .xplane.pb the profiler writes while run() runs."""
    d = tempfile.mkdtemp(prefix="jspec_trace_")
    with jax.profiler.trace(d):
        run()
    files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
    if not files:
        raise RuntimeError(f"the profiler wrote no .xplane.pb under {d}")
    return files[0]


def traced_events(fn, arg_sets, reps=10):
    """(name, duration_ns, start_ns) of every GPU event of len(arg_sets) * reps calls of fn,
    each call waited for (so calls never overlap), after one untimed call per arg set."""
    for args in arg_sets:  # warm (and compile if needed) outside the trace
        jax.block_until_ready(fn(*args))

    def run():
        for _ in range(reps):
            for args in arg_sets:
                jax.block_until_ready(fn(*args))
    path = _profiled(run)
    events = _device_events(path)
    if not events:
        seen = {p.name: [ln.name for ln in p.lines][:6] for p in ProfileData.from_file(path).planes}
        raise RuntimeError(f"no GPU stream events in the trace (is this a GPU backend?); planes/lines: {seen}")
    return events


def host_times(fn, reps=10):
    """{host event name: (us a call, events a call)} over reps calls of fn() back to back (one
    wait at the end, as a decode loop runs), from the profiler's host planes: the runtime's
    own events (the executable's launch, a CUDA graph's launch and update, argument handling)
    and Python's frames. Profiled, the host runs slower than unprofiled: compare shares."""
    jax.block_until_ready(fn())

    def run():
        out = None
        for _ in range(reps):
            out = fn()
        jax.block_until_ready(out)
    tot, cnt = collections.Counter(), collections.Counter()
    for plane in ProfileData.from_file(_profiled(run)).planes:
        if plane.name.startswith("/device"):
            continue
        for line in plane.lines:
            for ev in line.events:
                if any(f in ev.name for f in ("profiler.py", "contextlib.py", "gpu_trace.py")):
                    continue  # the trace's own frames
                tot[ev.name] += ev.duration_ns
                cnt[ev.name] += 1
    return {n: (ns / reps / 1e3, cnt[n] / reps) for n, ns in tot.most_common()}


def device_times(fn, arg_sets, reps=10):
    """Mean GPU time per call of fn over len(arg_sets) * reps calls, each call waited for
    (so calls never overlap). fn must already be compiled for these shapes."""
    events = traced_events(fn, arg_sets, reps)
    calls = reps * len(arg_sets)
    per_name = collections.Counter()
    for name, ns, _ in events:
        per_name[name] += ns
    # The union of the events' intervals: kernels launched with programmatic dependent
    # launch (PDL) overlap their predecessor, so their durations' sum counts the overlap
    # twice; the union is the time the GPU had any of the call's work in flight.
    union, end = 0, None
    for _, ns, t0 in sorted(events, key=lambda e: e[2]):
        t1 = t0 + ns
        if end is None or t0 >= end:
            union, end = union + ns, t1
        elif t1 > end:
            union, end = union + t1 - end, t1
    return {
        "busy_us": sum(per_name.values()) / calls / 1e3,
        "union_us": union / calls / 1e3,
        "kernels_us": {n: ns / calls / 1e3 for n, ns in per_name.most_common()},
    }


def time_tilings(make_fn, tilings, arg_sets, *, reps=5, check=None, log=""):
    """[(tiling, us | "Error: message", check(fn) | None)], fastest first: GPU time per call
    of make_fn(tiling) (a jitted fn of *arg_sets[i]) for each tiling. A tiling that fails to
    compile or run (e.g. more shared memory than an SM has) gets its error instead of a
    time. check(fn), if given, runs first (e.g. the error against a reference). log: print
    each row as it comes, after this prefix."""
    rows = []
    for tiling in tilings:
        fn = make_fn(tiling)
        try:
            checked = check(fn) if check else None
            us = device_times(fn, arg_sets, reps=reps)["busy_us"]
        except Exception as e:  # noqa: BLE001
            checked, us = None, f"{type(e).__name__}: {str(e)[:80]}"
        rows.append((tiling, us, checked))
        if log:
            print(log, tiling, us, "" if checked is None else checked, flush=True)
    return sorted(rows, key=lambda r: r[1] if isinstance(r[1], float) else 1e9)


def kernel_us(times, substring):
    """Mean us per call of the kernels whose name contains `substring`."""
    return sum(us for name, us in times["kernels_us"].items() if substring in name)
