"""Driving an engine by hand, step by step: requests added and aborted at chosen steps
(async scheduling, with and without speculation)."""

from __future__ import annotations


def drive(llm, script, max_steps=400):
    """Run the engine by hand: ``script[i]`` (a list of actions) runs before step i.
    Actions: ("add", rid, prompt, params), or ("abort", rid, k): abort rid before the first
    step at which it has emitted k tokens or more. Returns {rid: (tokens, finish_reason)}."""
    eng, done, aborts = llm.engine, {}, {}
    for i in range(max_steps):
        for act in script.get(i, ()):
            if act[0] == "add":
                eng.add_request(*act[1:])
            else:
                aborts[act[1]] = act[2]
        for rid, k in list(aborts.items()):
            seq = eng._seqs.get(rid)
            if seq is not None and len(seq.output_token_ids) >= k:
                done[rid] = (list(seq.output_token_ids), "abort")
                eng.abort_request(rid)
                del aborts[rid]
        for o in eng.step():
            if o.finished:
                done[o.request_id] = (o.token_ids, o.finish_reason)
        if i > max(script) and not aborts and not eng.has_unfinished_requests():
            break
    return done


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # every compile request, cache hit or not
_compile_log: list | None = None


def _on_duration(name, _secs, **_kw):
    if _compile_log is not None and name == _COMPILE_EVENT:
        _compile_log.append(name)


def precompile_then_warmup(eng, threads=2) -> tuple[int, int]:
    """``warmup.prepare`` (jspec/engine/warmup.py) on ``threads`` threads (the accelerator
    path; the CPU plan compiles on one), then ``eng.warmup()``: (compile requests during
    prepare, during warmup; small helper computations count too). Warmup's calls should
    find every executable compiled."""
    import jax

    from jspec.engine import warmup

    global _compile_log
    if not getattr(precompile_then_warmup, "listening", False):
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        precompile_then_warmup.listening = True
    counts = []
    r, c = eng.runner, eng.config
    calls = warmup.warmup_calls(r, eng.sched_steps, c.async_scheduling, c.warmup_structured_outputs)
    for run in (lambda: warmup.prepare(r, calls, threads), eng.warmup):
        _compile_log = []
        try:
            run()
        finally:
            counts.append(len(_compile_log))
            _compile_log = None
    return counts[0], counts[1]
