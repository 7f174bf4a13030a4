"""Gate backoff as a pure state machine: one bool in per planned window, the next windows to skip out.

After the k-th planned window in a row whose every slot the cost-benefit gate kept natural, the
next min(2**(k-1), cap) windows are skipped (no counting, no collective, natural order); a planned
window that moves anything ends the run. Every rank of every module sees the same gate results, so
every rank skips the same windows. `spec.reference.gate_backoff_skips` states the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Backoff:
    """cap: most windows skipped in a row (0: never skip); run: fully gated planned windows in a
    row; skip: windows still to skip."""

    cap: int = 0
    run: int = 0
    skip: int = 0

    def __post_init__(self):
        if isinstance(self.cap, bool) or not isinstance(self.cap, int) or self.cap < 0:
            raise ValueError(f"gate_backoff={self.cap!r} is invalid: windows skipped after gated ones must be "
                             "an integer >= 0")

    def planned(self, fully_gated: bool) -> "Backoff":
        """The state after a planned window (fully_gated: the gate kept every slot natural)."""
        if not self.cap:
            return self
        run = self.run + 1 if fully_gated else 0
        return replace(self, run=run, skip=min(2 ** (run - 1), self.cap) if run else 0)

    def skipped(self) -> "Backoff":
        """The state after a skipped window."""
        return replace(self, skip=self.skip - 1)
