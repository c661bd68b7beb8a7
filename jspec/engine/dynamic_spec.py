"""Dynamic speculation (plain Python): how many drafts each decode step verifies.

A decode step runs at one row width Q of ``widths`` (its program's shape, flat_input.py):
Q = 1 is plain decoding (the drafter only takes the step's tokens into its cache and
proposes nothing: the next step's rows have no drafts), Q = K + 1
verifies every draft, the widths between verify the first Q - 1 of the K the drafter
proposed. Before each decode call the engine asks ``choose`` for the width that emits the
most tokens per second:

    value(Q) = sum over rows of E_i(min(Q - 1, room_i)) / t(Q, N)

- E_i(k) = 1 + sum_{j<=k} prod_{l<=j} c_il: the tokens row i is expected to emit verifying
  k drafts, from its request's measured conditional acceptance c_il at draft position l
  (a decayed count, ``decay``, with ``prior`` pseudo-counts of the engine-wide rate,
  ``engine_rates``: the first position's starting at 1, a drafter trusted until measured,
  each later one at the position before's).
- t(Q, N): the measured time of a decode call of width Q at the batch bucket N (from its
  dispatch, or the read of the call before it, to its read: with async scheduling the
  host's work counts where the device waits for it). A width not yet run at N: the time
  warmup measured for it on empty rows (``warm``: no context, no host, but a lone call's
  launch), scaled by what the width in use measured against its own warm time; a width
  with neither (no warmup: a CPU) is tried once.
A request whose first draft is rarely accepted stops drafting: its rows verify nothing,
except one step in ``probe_every`` that measures it again. It stops when its estimate c_i1
is below ``min_first_acceptance`` while the engine-wide rate is too, or, among requests
whose drafts the drafter gets right, after a run of ``stop_after`` first drafts missed in
a row, which a drafter accepted at min_first_acceptance has in under 1% of its runs (a hit
ends the run). Not on c_i1 alone: a step's rows are [N, Q] whatever each verifies, so a
row that stops saves that step nothing, and a poor drafter's estimate over its last ten or
so verifications drops below the bar by chance: at synthetic tau 1.3 (an H200, 8B, 64 rows
of 256 tokens, 2026-11-29) a tenth of the rows had stopped at any time and the batch's
last row set its end, 240-251 decode calls where a replay of the policy without that
takes 215. While a batch runs plain nothing is measured: every ``probe_off_every`` steps
two steps draft again. Greedy and sampled output stay exactly as without: a row verifying fewer drafts, or
none, is rejection sampling over fewer positions (lossless at every count).

A step that also prefills (the scheduler's mixed policy) asks too, for its decode rows
before the prompts' chunks take the budget they leave (``choose(mixed=True)``).

``disable_by_batch_size`` (vLLM's key): at that many rows or more a step runs plain. With
``enabled`` False (speculative_config "dynamic", default off) and no such key, every step
verifies every draft.
"""

from __future__ import annotations

import collections
import math

import numpy as np


def decode_widths(K: int, dynamic: bool, disable_by_batch_size: int | None) -> tuple[int, ...]:
    """The decode step widths an engine with K drafts compiles: K + 1, with dynamic
    speculation also 1 and the powers of two between; 1 also for disable_by_batch_size."""
    if not dynamic:
        return (1, K + 1) if disable_by_batch_size else (K + 1,)
    return tuple(sorted({1, K + 1} | {2**i for i in range(1, K.bit_length() + 1) if 2**i < K + 1}))


def expected_tokens(rates: np.ndarray) -> np.ndarray:
    """f64[n, K + 1]: E_i(k), the tokens row i is expected to emit verifying k = 0..K drafts,
    from its conditional acceptance rates f64[n, K]."""
    c = np.cumsum(np.cumprod(rates, axis=1), axis=1)
    return 1 + np.concatenate([np.zeros((len(rates), 1)), c], axis=1)


class DynamicSpeculation:
    decay = 0.9  # a request's counts: about its last ten verifications
    global_decay = 0.99
    prior = 2.0  # pseudo-counts of the engine-wide rate in a request's estimate
    min_first_acceptance = 0.1
    stop_after = math.ceil(math.log(0.01) / math.log(1 - min_first_acceptance))  # 44 misses in a row
    probe_every = 16
    probe_off_every = 256  # steps at width 1 before two steps at the best drafting width
    switch_margin = 1.03  # a new width must promise this much more than the one in use
    plain_margin = 1.05  # drafting must promise this much more than plain
    refresh_every = 64

    def __init__(self, K: int, widths: tuple[int, ...], enabled: bool, disable_by_batch_size: int | None = None):
        self.K, self.widths, self.enabled = K, tuple(widths), enabled
        self.disable_by_batch_size = disable_by_batch_size
        # Decayed per-position counts, a row per request (``_slot``): tried[:, l] drafts at
        # position l + 1 verified, hit[:, l] accepted; one vectorized update per step, which
        # keeps the host's work small at hundreds of rows.
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self.tried, self.hit = np.zeros((0, K)), np.zeros((0, K))
        self.misses = np.zeros(0, np.int64)  # first drafts missed in a row since the last hit
        self.all_tried, self.all_hit = np.zeros(K), np.zeros(K)  # engine-wide
        self._skipped: dict[str, int] = {}  # request id -> steps since it last drafted (stopped requests)
        self.warm: dict[tuple[int, int], float] = {}  # (Q, N) -> seconds on empty rows (warmup)
        self._recent: dict[tuple[int, int], collections.deque] = {}  # (Q, N) -> its last measured seconds
        self.times: dict[tuple[int, int], float] = {}  # (Q, N) -> their median
        self._measured_at: dict[tuple[int, int], int] = {}  # (Q, N) -> num_decode_steps then
        self.current: dict[int, int] = {}  # N -> the width in use
        self._plain: dict[int, int] = {}  # N -> steps at width 1 since the last probe
        self._probe: dict[int, int] = {}  # N -> probe steps left
        self.steps_by_width: collections.Counter = collections.Counter()
        self.mixed_by_width: collections.Counter = collections.Counter()  # mixed steps' decode rows, by their cap
        self.num_decode_steps = 0
        self.num_scheduled_drafts = 0

    # ---- what the engine reports ---------------------------------------------------------
    def _slot(self, request_id: str) -> int:
        i = self._slots.get(request_id)
        if i is None:
            if not self._free:  # grow the tables
                n = len(self.tried)
                self.tried = np.concatenate([self.tried, np.zeros((max(n, 8), self.K))])
                self.hit = np.concatenate([self.hit, np.zeros((max(n, 8), self.K))])
                self.misses = np.concatenate([self.misses, np.zeros(max(n, 8), np.int64)])
                self._free = list(range(len(self.tried) - 1, n - 1, -1))
            i = self._slots[request_id] = self._free.pop()
            self.tried[i], self.hit[i], self.misses[i] = 0, 0, 0
        return i

    def record_acceptance(self, rows: list[tuple[str, int, int]]):
        """One step's verifications: (request id, drafts verified k, accepted a) per row; a
        row tried positions 1..min(a + 1, k) and hit 1..a."""
        rows = [r for r in rows if r[1] > 0]
        if not rows:
            return
        idx = np.array([self._slot(rid) for rid, _, _ in rows])
        k = np.array([r[1] for r in rows])
        a = np.array([r[2] for r in rows])
        pos = np.arange(self.K)[None]
        tried, hit = pos < np.minimum(a + 1, k)[:, None], pos < a[:, None]
        self.tried[idx] = self.tried[idx] * self.decay + tried
        self.hit[idx] = self.hit[idx] * self.decay + hit
        self.misses[idx] = np.where(a > 0, 0, self.misses[idx] + 1)
        self.all_tried = self.all_tried * self.global_decay ** len(rows) + tried.sum(0)
        self.all_hit = self.all_hit * self.global_decay ** len(rows) + hit.sum(0)

    def record_time(self, q: int, N: int, seconds: float):
        """A decode call of width q at batch bucket N took ``seconds`` (its dispatch, or the
        read of the call before it, to its own read)."""
        recent = self._recent.setdefault((q, N), collections.deque(maxlen=5))
        recent.append(seconds)
        # a stall (a prefill's admission, the host) is no trend: the median of five (the least of fewer)
        self.times[(q, N)] = float(np.median(recent) if len(recent) >= 3 else min(recent))
        self._measured_at[(q, N)] = self.num_decode_steps

    def forget(self, request_id: str):
        i = self._slots.pop(request_id, None)
        if i is not None:
            self._free.append(i)
        self._skipped.pop(request_id, None)

    # ---- the choice ----------------------------------------------------------------------
    def rates(self, request_ids: list[str], idx: list[int] | None = None) -> np.ndarray:
        """f64[n, K] each request's conditional acceptance estimate per draft position (``idx``:
        their rows of the tables, -1 for none, when the caller looked them up already)."""
        g = self.engine_rates()
        idx = [self._slots.get(rid, -1) for rid in request_ids] if idx is None else idx
        known = np.array([i >= 0 for i in idx])
        out = np.broadcast_to(g, (len(idx), self.K)).copy()
        if known.any():
            j = np.array([i for i in idx if i >= 0])
            out[known] = (self.hit[j] + self.prior * g) / (self.tried[j] + self.prior)
        return out

    def engine_rates(self) -> np.ndarray:
        """f64[K] the engine-wide conditional acceptance per draft position, each with one
        pseudo-count of the position before's (the first's: 1, a drafter trusted until
        measured). A later position is tried only after an acceptance at every position
        before it, so its counts come slowly: a prior of 1 there read a position never tried
        as always accepted."""
        out, prev = np.empty(self.K), 1.0
        for l in range(self.K):
            out[l] = prev = (self.all_hit[l] + prev) / (self.all_tried[l] + 1)
        return out

    def _time(self, q: int, N: int, cur: int) -> float | None:
        """Estimated seconds of a width-q call at N: measured, else warmup's time on empty rows
        scaled by what the width in use ``cur`` measured against its own (context, host);
        None: neither (try it)."""
        t = self.times.get((q, N))
        if t is not None or (q, N) not in self.warm:
            return t
        c, w = self.times.get((cur, N)), self.warm.get((cur, N))
        return self.warm[(q, N)] * (c / w if c and w else 1.0)

    def choose(self, rows: list[tuple[str, int, int]], N: int, fixed: bool = False,
               mixed: bool = False) -> tuple[int, list[int]]:
        """The width of a decode call over ``rows`` at batch bucket N, and the drafts each row
        verifies. A row: (request id, drafts it may verify in a steady state (room left
        before max_model_len, at most K), drafts it has now (none after a plain step)). The
        width is chosen for the steady state: the first step after a plain one verifies
        nothing and proposes. ``fixed``: the full width (a batch with a grammar: its masked
        programs exist at K + 1 only).

        ``mixed``: the decode rows of a step that also prefills (the scheduler's mixed
        policy). Such a step's shape is its token count, whatever each row verifies, and
        its time is not recorded (the prefill's share is unknown): its rows verify up to
        the width decode calls of as many rows would choose from the times known, with
        nothing tried, probed or timed for it. A verified draft there takes a prompt
        token's place in the step's budget; at many rows (compute-bound) that is the
        trade a wide decode call makes too, at few rows it costs the step little."""
        if not mixed:
            self.num_decode_steps += 1
        rids = [r[0] for r in rows]
        room = np.array([r[1] for r in rows], np.int64)
        have = np.array([r[2] for r in rows], np.int64)
        dynamic = self.enabled and not fixed and 1 in self.widths
        slots = [self._slots.get(rid, -1) for rid in rids] if dynamic else None  # once for rates and miss runs
        rates = self.rates(rids, slots) if dynamic else None
        q = self._width(rates, room, N, fixed, explore=not mixed)
        ks = np.minimum(np.minimum(room, have), q - 1)
        if dynamic and q > 1:  # requests that stopped drafting: one probe in probe_every
            runs = np.array([self.misses[j] if j >= 0 else 0 for j in slots])
            stop = runs >= self.stop_after
            if self.engine_rates()[0] < self.min_first_acceptance:
                stop |= rates[:, 0] < self.min_first_acceptance
            for i in np.flatnonzero(stop & (ks > 0)):
                n = self._skipped.get(rids[i], 0) + 1
                self._skipped[rids[i]] = n % self.probe_every
                ks[i] = ks[i] if n >= self.probe_every else 0
        (self.mixed_by_width if mixed else self.steps_by_width)[q] += 1
        self.num_scheduled_drafts += int(ks.sum())
        return q, ks.tolist()

    def _width(self, rates, room, N: int, fixed: bool, explore: bool = True) -> int:
        """``explore`` False (a mixed step's rows): the best width among those with a time
        known, the one in use when none is; nothing tried or probed."""
        full = self.K + 1
        if self.disable_by_batch_size and len(room) >= self.disable_by_batch_size and not fixed:
            return 1
        if rates is None:
            return full
        if explore and self._probe.get(N):  # plain probe_off_every steps: two steps of the best drafting width
            self._probe[N] -= 1
            return self.current[N]
        cur = self.current.get(N, full)
        E = expected_tokens(rates)
        rows = np.arange(len(room))
        values = {}
        for q in self.widths:
            t = self._time(q, N, cur)
            if t is None and not explore:
                continue
            if t is None:  # never run at this batch: run it once
                self.current[N] = q
                return q
            values[q] = E[rows, np.minimum(room, q - 1)].sum() / max(t, 1e-9)
        if not values:
            return cur
        # drafting must promise more than plain by a margin: its rows end unevenly (a call's
        # last rows run alone) and the drafter's share of the prefill is not in the model
        if 1 in values:
            values[1] *= self.plain_margin
        best = max(values, key=values.get)
        if cur in values and values[best] < self.switch_margin * values[cur]:
            best = cur
        if not explore:
            return best
        # A width close behind is timed when it never was at N (its estimate is warmup's, scaled),
        # and again after refresh_every steps; plain's calls are left alone but for the first.
        stale = [q for q in values if q != best and values[q] > 0.8 * values[best]
                 and ((q, N) not in self.times or best != 1)
                 and self.num_decode_steps - self._measured_at.get((q, N), -self.refresh_every - 1) > self.refresh_every]
        if stale:
            best = max(stale, key=values.get)
            self._measured_at[(best, N)] = self.num_decode_steps  # once, even if its time is not recorded
            return best
        if best == 1:
            self._plain[N] = self._plain.get(N, 0) + 1
            if self._plain[N] >= self.probe_off_every:  # acceptance is not measured while plain
                self._plain[N] = 0
                best = max((q for q in values if q > 1), key=values.get)
                self._probe[N] = 1
        self.current[N] = best
        return best

    def stats(self) -> dict:
        """Counters for LLMEngine.stats: decode calls by width, mixed steps by their rows' cap, drafts
        scheduled per step with decode rows."""
        n = self.num_decode_steps + sum(self.mixed_by_width.values())
        return {"decode_steps_by_width": dict(sorted(self.steps_by_width.items())),
                "mixed_steps_by_width": dict(sorted(self.mixed_by_width.items())),
                "num_decode_steps": self.num_decode_steps, "num_scheduled_drafts": self.num_scheduled_drafts,
                "mean_drafts_per_step": self.num_scheduled_drafts / n if n else 0.0}
