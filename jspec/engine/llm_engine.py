"""LLMEngine: requests in, tokens out, one scheduling step at a time.

Not thread-safe: one thread drives it (jspec.LLM.generate, or the server's engine loop).
With async scheduling a decode call may still be running on the device when ``step()``
returns (``_inflight``); the next ``step()`` reads it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from jspec import parallel
from jspec.checkpoint.model_files import generation_eos, load_tokenizer, sampling_defaults
from jspec.checkpoint.target import auto_dtype, load_target, quantize_target, resolve_dtype
from jspec.config import load_model_config
from jspec.engine import mirror
from jspec.engine.block_manager import BlockManager
from jspec.engine.dynamic_spec import DynamicSpeculation, decode_widths
from jspec.engine.engine_config import EngineConfig, checked_max_model_len, default_token_budget, fp8_kv_cache
from jspec.engine.flat_input import FlatShapes
from jspec.engine.flat_runner import FlatRunner
from jspec.engine.kv_memory import (
    claim_device_memory,
    create_pools,
    device_bytes_in_use,
    log_device_memory_claim,
)
from jspec.engine.logprobs import record_logprobs, record_prompt_logprobs
from jspec.engine.outputs import CompletionOutput, RequestOutput, SampleGroups, make_output  # noqa: F401 (re-exported)
from jspec.engine.recovery import restore_after_failure
from jspec.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from jspec.engine.sequence import Sequence, SpecMetrics, Status
from jspec.engine.speculation import load_speculation
from jspec.engine.stopping import append_tokens
from jspec.engine.structured import GrammarCompiler, advance, any_grammar
from jspec.engine.warmup import warm_engine
from jspec.inputs import check_cache_salt, parse_prompt
from jspec.ops import plan_kernels, plan_params
from jspec.parallel import multihost
from jspec.sampling_params import SamplingParams

logger = logging.getLogger("jspec.engine")


@dataclasses.dataclass
class _InFlight:
    """A decode call dispatched but not yet read (async scheduling)."""

    sched: SchedulerOutput  # its rows, in the order of the call's batch (a decode row: 1 + drafts it verifies)
    steps: int  # FlatRunner.dispatch's: decode steps fed back (1: one step, or a verification)
    out: object  # on the device: the call's output (None until a split call's tail is dispatched)
    split: object = None  # structured outputs: the forward's Split
    q: int | None = None  # a speculative decode call's row width (1: nothing verified nor proposed)
    t0: float = 0.0  # when its dispatch returned (time.monotonic)
    c0: int = 0  # the runner's compilations then


class LLMEngine:
    def __init__(self, config: EngineConfig, sharding=None, *, preloaded=None, preloaded_drafter=None):
        """``preloaded=(ModelConfig, params)`` (and ``preloaded_drafter=(DrafterConfig,
        params)``) skip the checkpoint: benchmarks use random weights made on the device."""
        t0 = time.monotonic()
        # both before anything starts jax's backend
        multihost.initialize(config.nnodes, config.node_rank, config.master_addr, config.master_port)
        claim_device_memory(config.gpu_memory_utilization)
        if config.dtype == "auto":
            mc_dtype = preloaded[0].dtype if preloaded is not None else load_model_config(config.model).dtype
            config = dataclasses.replace(config, dtype=auto_dtype(mc_dtype, jax.default_backend()))
        self.config = c = config
        devices = jax.devices()
        # The engine's own bytes on the device (weights, drafter), for the KV cache's share:
        # what loading adds, plus preloaded trees (on the device already).
        own_before = device_bytes_in_use() - sum(
            a.nbytes for t in (preloaded, preloaded_drafter) if t is not None for a in jax.tree.leaves(t[1]))
        kinds = ", ".join(sorted({str(getattr(d, "device_kind", d)) for d in devices}))
        log_device_memory_claim()
        logger.info("jspec engine on %s (%s x%d), dtype %s", jax.default_backend(), kinds, len(devices), c.dtype)
        self.par = parallel.EngineMesh.create(c.tensor_parallel_size, sharding, preloaded)
        self.default_sampling = {} if preloaded is not None else sampling_defaults(c.generation_config, c.model)
        if preloaded is None:
            t = time.monotonic()
            with ThreadPoolExecutor(1) as pool:  # the tokenizer (seconds of the host's) read beside the weights
                tokenizer = pool.submit(load_tokenizer, c.tokenizer or c.model, required=c.tokenizer is not None)
                self.model_cfg, params = load_target(c.model, c.dtype, self.par.placement(sharding),
                                                     load_format=c.load_format, quantization=c.quantization,
                                                     kv_cache_scales=fp8_kv_cache(c))
                logger.info("target loaded in %.1f s (%s)", time.monotonic() - t, c.load_format)
                self.tokenizer, gen_eos = tokenizer.result(), generation_eos(c.model)
        else:
            (self.model_cfg, params), self.tokenizer, gen_eos = preloaded, None, ()
            if c.quantization is not None:
                self.model_cfg, params = quantize_target(self.model_cfg, params, c.quantization, c.dtype)
        mc = self.model_cfg
        self.model_name = os.path.basename(os.path.normpath(c.model))
        self.eos_token_ids = set(mc.eos_token_ids) | set(gen_eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.max_model_len = checked_max_model_len(c, mc.max_position_embeddings)
        self.sched_steps = c.num_scheduler_steps  # decode steps per call (1 with a drafter: below)
        sp = load_speculation(c, mc, self.par, sharding, preloaded_drafter)
        self.spec, self.dcfg, self.K, self.lookahead = sp.spec, sp.dcfg, sp.K, sp.lookahead
        self.draft_max_len = sp.draft_max_len
        if self.spec is not None and c.num_scheduler_steps > 1:
            logger.warning("num_scheduler_steps=%d applies without speculation only: one step per call with "
                           "a drafter (async scheduling overlaps the host's work)", c.num_scheduler_steps)
            self.sched_steps = 1
        pages_per_seq = -(-(self.max_model_len + self.lookahead) // c.page_size)
        dtype = resolve_dtype(c.dtype)
        kv, dkv, num_pages = create_pools(c, mc, self.dcfg, self.par, pages_per_seq, self.max_model_len, dtype,
                                          own_bytes=device_bytes_in_use() - own_before,
                                          logit_rows=c.max_num_seqs * (self.K + 1))
        chunk = min(c.max_prefill_chunk, self.max_model_len)
        # EAGLE-style drafters: their KV at p depends on token p + 1 (see BlockManager).
        eagle_style = sp.reads_next_token
        mix = c.max_num_partial_prefills
        sched_cfg = SchedulerConfig(
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens or default_token_budget(c, self.K, chunk),
            max_prefill_chunk=chunk,
            max_model_len=self.max_model_len,
            lookahead=self.lookahead,
            # EAGLE-style drafters need the target hidden states of the last hit page
            # (and their own KV there depends on the token after it): recompute it.
            drop_last_prefix_hit=eagle_style,
            max_prefill_rows=mix,
            num_drafts=self.K,
        )
        self.blocks = BlockManager(num_pages, c.page_size, c.enable_prefix_caching, hash_next_token=eagle_style)
        self.scheduler = Scheduler(sched_cfg, self.blocks)
        plan = plan_kernels(mc, attn_impl=c.attn_impl, linear_impl=c.linear_impl, sample_impl=c.sample_impl,
                            **self.par.plan_args())
        params = plan_params(plan, params)  # the weight layout the plan's modules declare
        # the most tokens a step can hold: decode rows and at most ``mix`` chunks when mixing
        most = (c.max_num_seqs * (self.K + 1) + mix * chunk) if mix else c.max_num_seqs * chunk
        dynamic = self.spec is not None and self.spec.dynamic
        off_at = self.spec.disable_by_batch_size if self.spec is not None else None
        widths = decode_widths(self.K, dynamic, off_at) if self.K else ()
        self.policy = DynamicSpeculation(self.K, widths, dynamic, off_at) if self.K else None
        if mix and (dynamic or off_at):
            self.scheduler.mixed_drafts = lambda dec: self._widths(
                dec, [r.num_new - 1 for r in dec.seqs], mixed=True)[1]
        shapes = FlatShapes.create(c.max_num_seqs, min(sched_cfg.max_num_batched_tokens, most), chunk, q=self.K + 1,
                                   widths=widths)
        self.runner = FlatRunner(mc, params, kv, shapes, width=pages_per_seq, dtype=dtype, plan=plan, spec=self.spec,
                                 dcfg=self.dcfg, dparams=plan_params(plan, sp.dparams) if self.spec else None, dkv=dkv,
                                 max_num_seqs=c.max_num_seqs)
        self.runner.configure_sampling(self.eos_token_ids, c.max_logprobs, c.logprobs_mode)
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, self.eos_token_ids)  # structured outputs
        self._groups = SampleGroups()  # requests with n > 1
        self._inflight: _InFlight | None = None
        self._rng = np.random.default_rng(c.seed)
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = 0
        self.spec_metrics = SpecMetrics()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_chained_calls = 0  # decode calls dispatched before the previous one was read
        self._last_read = 0.0  # when the host last read a call's output (time.monotonic)
        self._compiles_at_read = 0  # the runner's compilations then
        logger.info("engine ready in %.1f s", time.monotonic() - t0)

    # ---- requests ---------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.blocks.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.blocks.num_free_pages

    def tokenize(self, prompt, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids: a string through the tokenizer (with its special tokens, a
        BOS, unless ``add_special_tokens`` is False), token ids as they are."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the model folder has no tokenizer; pass token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def validate(self, prompt, params) -> list[int]:
        """Token ids of a valid request (the prompt: a string, token ids, or vLLM's TextPrompt
        or TokensPrompt dict); ValueError naming the problem otherwise."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be jspec.SamplingParams, got {type(params).__name__}")
        prompt = parse_prompt(prompt)[0]
        ids = self.tokenize(prompt)
        if not ids or prompt == "":  # "" is empty too, though the tokenizer gives it a BOS (as the server says)
            raise ValueError("prompt is empty")
        V = self.model_cfg.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < V:
                raise ValueError(f"prompt token {i} = {t!r} is not a token id in [0, {V})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room "
                             "to generate")
        params.verify(V, self.tokenizer, self.config.max_logprobs)
        self.grammars.check(params)
        return [int(t) for t in ids]

    def add_request(self, request_id: str, prompt, params: SamplingParams, *, prompt_token_ids=None,
                    cache_salt: str | None = None):
        """Queue a request. With ``params.n`` > 1 its samples run as n sequences (seeds
        seed + i, as vLLM) and ``step`` returns one RequestOutput with n ``outputs``.
        ``cache_salt`` (or a prompt dict's): only requests with the same salt share cached pages."""
        if request_id in self._seqs or request_id in self._groups.children:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt, salt = parse_prompt(prompt)
        cache_salt = check_cache_salt(cache_salt)
        if salt is not None and cache_salt is not None and salt != cache_salt:
            raise ValueError(f"cache_salt={cache_salt!r} contradicts the prompt's cache_salt {salt!r}")
        salt = cache_salt if cache_salt is not None else salt
        ids = prompt_token_ids if prompt_token_ids is not None else self.validate(prompt, params)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be jspec.SamplingParams, got {type(params).__name__}")
        bad_words = params.verify(self.model_cfg.vocab_size, self.tokenizer, self.config.max_logprobs)
        self.grammars.check(params)
        if params.n > 1:
            for i, cid in enumerate(self._groups.add(request_id, params.n)):
                seed = None if params.seed is None else (params.seed + i) % 2**63
                self._add(cid, prompt, dataclasses.replace(params, n=1, seed=seed), ids, bad_words, salt)
            return
        self._add(request_id, prompt, params, ids, bad_words, salt)

    def _add(self, request_id, prompt, params, ids, bad_words, salt):
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        seq = Sequence(request_id, ids, params, seed, self._arrivals, bad_words_ids=bad_words, cache_salt=salt)
        seq.prompt_text = prompt if isinstance(prompt, str) else None
        seq.arrival_time = time.time()
        seq.grammar = self.grammars.matcher(params)
        if seq.grammar is not None:
            seq.grammar_closers = self.grammars.closers()
        self.num_prompt_tokens += len(ids)
        self._arrivals += 1
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str):
        for cid in self._groups.pop(request_id):
            self.abort_request(cid)
        seq = self._seqs.pop(request_id, None)
        if seq is not None and seq.status is not Status.FINISHED:
            self.scheduler.finish(seq, "abort")
        if self.policy is not None:
            self.policy.forget(request_id)

    def warmup_shapes(self) -> list:
        """The shapes ``warmup`` compiles (``FlatShape``s): every one a request can reach."""
        return self.runner.warmup_shapes(self.sched_steps, self._async)

    def warmup(self, progress: bool = False):
        """Prepare every step's executable now (jspec/engine/warmup.py, ``warm_engine``):
        after it no request compiles. ``progress``: a progress bar."""
        warm_engine(self, progress)

    @property
    def _async(self) -> bool:
        return self.config.async_scheduling

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's reset_prefix_cache): False, with nothing changed,
        while a request holds pages."""
        if any(self.blocks.ref):
            logger.warning("the prefix cache was not reset: requests still hold pages")
            return False
        self.blocks.forget_cached_pages()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step ---------------------------------------------------------------------
    def _can_grow(self, sched: SchedulerOutput, n: int) -> bool:
        """Every row may emit n more tokens (max_tokens, max_model_len) and has pages for n
        more positions (reserved here; a row that cannot grow that far keeps what it got)."""
        for r in sched.seqs:
            s = r.seq
            if min(s.params.max_tokens - len(s.output_token_ids), self.max_model_len - s.num_tokens) < n:
                return False
        return all(self.blocks.ensure_slots(r.seq, r.seq.num_computed + n) for r in sched.seqs)

    def _decode_steps(self, sched) -> int:
        """Steps of a fed-back decode call for this batch (with a drafter: 1, a verification
        step); 0: a step fed by the host and read before the next."""
        n = self.sched_steps
        if sched.kind != "decode":
            return 0
        if n <= 1 or any_grammar(sched.seqs):  # a grammar's mask holds for one step
            return 1 if self._async else 0
        # A batch that cannot grow n positions, or that a waiting request could join, takes a plain step.
        if sched.preempted or self.scheduler.can_admit() or not self._can_grow(sched, n):
            return 0
        return n

    def _chain(self, f: _InFlight) -> _InFlight | None:
        """Dispatch the call after ``f`` (same rows, further on) before ``f`` is read, when
        nothing can change the batch in between: no request waiting that could join now,
        every row still running with room and pages for both calls. A call moves each row by
        up to steps x (K + 1) positions, and a drafter writes ``lookahead`` past them."""
        # A waiting request that could be admitted now goes into the next step; one that cannot
        # (max_num_seqs run: saturation) waits for a row to end, one call later when chained.
        sch = self.scheduler
        if not self._async or len(sch.running) != len(f.sched.seqs) or sch.can_admit():
            return None
        if any(r.seq.status is not Status.RUNNING or self._seqs.get(r.seq.request_id) is not r.seq
               for r in f.sched.seqs):
            return None
        # f's positions are not counted yet. With a drafter both calls verify all K drafts and
        # the drafts after them are not trimmed (_draft_room): the device drafts K for every
        # row, and max_tokens may cut either call's output (_advance drops the rest); without
        # one every row must be able to emit both calls' tokens.
        grow = 2 * f.steps * (self.K + 1)
        if any(self._draft_room(r.seq.num_tokens + grow) < self.K for r in f.sched.seqs):
            return None
        if self.K == 0 and not self._can_grow(f.sched, grow):
            return None
        if not all(self.blocks.ensure_slots(r.seq, r.seq.num_computed + grow + self.lookahead) for r in f.sched.seqs):
            return None
        self.num_chained_calls += 1
        # f proposed K drafts a row, unless it ran at width 1
        q, sched = self._widths(f.sched, [0 if f.q == 1 else self.K] * len(f.sched.seqs))
        if any_grammar(f.sched.seqs):  # its masks need f's tokens: the forward now, the rest in step()
            split = self.runner.dispatch_forward(sched, f.out)
            return _InFlight(sched, 1, None, split, q=q, t0=time.monotonic(), c0=self.runner.num_compilations)
        out = self.runner.dispatch(sched, f.steps, prev=f.out, q=q)
        return _InFlight(sched, f.steps, out, q=q, t0=time.monotonic(), c0=self.runner.num_compilations)

    def _widths(self, sched: SchedulerOutput, have: list[int],
                mixed: bool = False) -> tuple[int | None, SchedulerOutput]:
        """A speculative decode call's row width (dynamic speculation, ``DynamicSpeculation.choose``)
        and its rows, each verifying the drafts chosen for it of the ``have`` it holds (``mixed``:
        a step that also prefills, Scheduler.mixed_drafts). Without a drafter: (None, sched)."""
        if not self.K or sched.kind != "decode":
            return None, sched
        rows = sched.seqs
        N = self.runner.shapes.decode_shape(len(rows)).seqs
        q, ks = self.policy.choose([(r.seq.request_id, self._draft_room(r.seq.num_tokens), h)
                                    for r, h in zip(rows, have)], N, fixed=any_grammar(rows), mixed=mixed)
        rows = [ScheduledSeq(r.seq, 1 + k, r.sample) for r, k in zip(rows, ks)]
        return q, SchedulerOutput("decode", rows, sched.preempted)

    def _collect(self, f: _InFlight) -> list[RequestOutput]:
        """Read a dispatched call (waits for the device) and apply its tokens. Rows that
        stopped or were aborted meanwhile are skipped: a chained call ran past them."""
        res = self.runner.read(f.out, len(f.sched.seqs), f.steps, f.q)
        self._timed(f)
        live = [r.seq.status is Status.RUNNING for r in f.sched.seqs]
        return [o for r, (toks, n, lp), ok in zip(f.sched.seqs, self._apply(f.sched, res, live), live)
                if ok and (o := self._advance(r.seq, toks, n, lp)) is not None]

    def _timed(self, f: _InFlight):
        """Record a speculative decode call's time for dynamic speculation: from its dispatch,
        or the read of the call before it when that came later (the host's work between
        reads counts: chained calls wait for it), to its own read; not when anything
        compiled meanwhile (a first call of a shape, without warmup)."""
        now, compiles = time.monotonic(), self.runner.num_compilations
        start, c_start = (f.t0, f.c0) if f.t0 > self._last_read else (self._last_read, self._compiles_at_read)
        if f.q is not None and compiles == c_start:
            self.policy.record_time(f.q, self.runner.shapes.decode_shape(len(f.sched.seqs)).seqs, now - start)
        self._last_read, self._compiles_at_read = now, compiles

    def _running_ids(self) -> set:
        """Ids of the running requests (the runner keeps their draft-probability rows)."""
        return {s.request_id for s in self.scheduler.running}

    def _apply(self, sched, res, live=None) -> list[tuple[list[int], int, np.ndarray | None]]:
        """Per row of a step's result: record acceptance, set the next drafts, and return
        (emitted tokens, positions newly computed, their logprob blocks or None). A decode
        row computed the positions of the tokens it emitted; a prefill row its chunk. Rows
        not ``live`` are left alone."""
        out, verified = [], []
        for i, r in enumerate(sched.seqs):
            seq = r.seq
            lp = None if res.logprobs is None else res.logprobs[i]
            if live is not None and not live[i]:
                out.append(([], 0, None))
                continue
            if sched.kind == "decode" or i < sched.num_decode:  # a decode row ("mixed": the first rows)
                n_emit = int(res.num_emitted[i])
                # the drafts it verified: its own, up to the call's choice (a grammar may have cut them)
                n_draft = min(len(seq.draft_token_ids), r.num_new - 1)
                if n_draft:
                    seq.metrics.record(n_draft, n_emit - 1, self.K)
                    self.spec_metrics.record(n_draft, n_emit - 1, self.K)
                    verified.append((seq.request_id, n_draft, n_emit - 1))
                out.append((res.tokens[i, :n_emit].tolist(), n_emit, lp))
            else:
                out.append(([int(res.tokens[i, 0])] if r.sample else [], r.num_new, lp))
            seq.draft_token_ids = res.drafts[i, : self._draft_room(seq.num_tokens + len(out[-1][0]))].tolist() \
                if r.sample else []
        if verified:
            self.policy.record_acceptance(verified)
        return out

    def _draft_room(self, num_tokens: int) -> int:
        """Drafts a sequence of ``num_tokens`` tokens may verify next. Draft j sits at
        position num_tokens - 1 + j: verification of n drafts may emit n + 1 tokens, which
        must stay within max_model_len, and no draft goes past the drafter's own
        max_position_embeddings (vLLM's guard: its positions were never trained)."""
        room = min(self.max_model_len - num_tokens - 1, self.draft_max_len - num_tokens)
        return max(0, min(self.K, room))

    def lead(self):  # node 0 of several: the others connected, each call sent to them from now on
        mirror.lead(self.runner, self.config, self.close)

    def follow(self) -> int:  # nodes >= 1 of several (jspec/engine/mirror.py): node 0's calls, until it closes
        return mirror.follow_node(self.runner, self.config)

    def close(self):  # node 0 of several: the others stop following
        mirror.close_node(self.runner, self.config)

    def step(self) -> list[RequestOutput]:
        if self.config.nnodes > 1 and self.runner.leader is None:  # node 0's first step: the others join
            self.lead()
        f, self._inflight = self._inflight, None
        try:
            if f is None:
                sched = self.scheduler.schedule()
                if sched is None or not sched.seqs:
                    return []
                n = self._decode_steps(sched)
                q, sched = self._widths(sched, [r.num_new - 1 for r in sched.seqs])
                out = self.runner.dispatch(sched, n, running=self._running_ids(), q=q)
                f = _InFlight(sched, n, out, q=q, t0=time.monotonic(), c0=self.runner.num_compilations)
                if n == 0:  # read before the next step
                    res = self.runner.read(out, len(sched.seqs), 0, q)
                    self._timed(f)
                    record_prompt_logprobs(sched.seqs, res.prompt_logprobs, self.runner.n_top_logprobs,
                                           self.tokenizer)
                    return self._groups.merge([o for r, (toks, computed, lp) in zip(sched.seqs, self._apply(sched, res))
                                               if (o := self._advance(r.seq, toks, computed, lp)) is not None])
            # The next call goes to the device before this one is read: the host work below
            # (and the caller's, until the next step()) overlaps the device's.
            self._inflight = nxt = self._chain(f)
            outs = self._collect(f)
            if nxt is not None and nxt.split is not None:  # structured: masks built while its forward runs
                nxt.out = self.runner.dispatch_tail(nxt.split, nxt.sched)
            return self._groups.merge(outs)
        except BaseException as e:
            self._inflight = None  # a failed step leaves nothing chained behind it
            multihost.check_step_failure(e)
            # over several nodes a failed step is a node's failure (multihost.py): no local repair
            if jax.process_count() == 1 and (n := restore_after_failure(self.runner, self.scheduler)) is not None:
                logger.error("a step failed on the device and took the KV caches with it: zeroed caches in "
                             "their place, %d running requests preempted", n)
            raise

    def _advance(self, seq: Sequence, toks: list[int], computed: int, lps=None) -> RequestOutput | None:
        """Apply a row's step: positions computed, tokens emitted (with their logprob blocks
        i32[len(toks), F] when the step had processors), finish or commit pages."""
        seq.num_computed += computed
        new = append_tokens(seq, toks, self.eos_token_ids, self.max_model_len, self.tokenizer)
        new = advance(seq, new)  # structured outputs: the grammar takes the tokens, cuts the next drafts
        self.num_generation_tokens += len(new)
        if seq.params.logprobs is not None and lps is not None:
            record_logprobs(seq, new, lps, self.runner.n_top_logprobs, self.tokenizer)
        # Pages filled by this step join the prefix cache even when the sequence ends here
        # (a chat's next turn starts with this one's prompt and output).
        self.blocks.commit(seq, seq.num_computed)
        if new:
            seq.last_token_time = time.time()
            if seq.first_token_time is None:
                seq.first_token_time = seq.last_token_time
        if seq.finish_reason:
            seq.finished_time = time.time()
            self.scheduler.finish(seq, seq.finish_reason)
            self._seqs.pop(seq.request_id, None)
            if self.policy is not None:
                self.policy.forget(seq.request_id)
        return make_output(seq, new, self.tokenizer) if new or seq.finish_reason else None

    def stats(self) -> dict:
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            **self.spec_metrics.as_dict(),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hits": self.blocks.hits,
            "prefix_cache_queries": self.blocks.queries,
            "prefix_cache_hit_tokens": self.blocks.hit_tokens,
            "prefix_cache_query_tokens": self.blocks.query_tokens,
            "num_free_pages": self.num_free_pages,
            "num_pages": self.num_pages,
            "num_compilations": self.runner.num_compilations,
            "num_chained_calls": self.num_chained_calls,
            "num_mixed_steps": getattr(self.runner, "num_mixed_steps", 0),
            **(self.policy.stats() if self.policy is not None else {}),
        }
