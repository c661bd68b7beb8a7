"""Per-request sampling parameters (vLLM's names and meanings)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 -> greedy
    top_k: int = 0  # <= 0 -> off (vLLM also accepts -1)
    top_p: float = 1.0  # 1 -> off
    max_tokens: int = 16
    seed: int | None = None  # None -> the engine draws one (still stateless per position)
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        # Checked here so a bad request fails before it reaches the scheduler.
        def bad(msg):
            raise ValueError(f"SamplingParams: {msg}")

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            bad(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
