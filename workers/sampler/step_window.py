"""The torch sampler's recent decode steps: its tokens/s and occupancy, and the
periodic log line that reports them."""

from __future__ import annotations

import logging
import time
from collections import deque

from treadle.common.engine.stats import SamplerStats

log = logging.getLogger("treadle.sampler")

#: decode steps the rate and occupancy are taken over
WINDOW = 64


class StepWindow:
    """(time, tokens generated so far, rows decoding) of the last ``WINDOW`` steps."""

    def __init__(self) -> None:
        self._steps: deque[tuple[float, int, int]] = deque()

    def record(self, tokens_generated: int, rows: int) -> None:
        self._steps.append((time.monotonic(), tokens_generated, rows))
        while len(self._steps) > WINDOW:
            self._steps.popleft()

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the window (0 once idle for 5 s)."""
        steps = self._steps
        if len(steps) > 1 and time.monotonic() - steps[-1][0] < 5.0:
            return (steps[-1][1] - steps[0][1]) / max(steps[-1][0] - steps[0][0], 1e-9)
        return 0.0

    def occupancy(self, num_slots: int) -> float:
        """The mean fraction of ``num_slots`` decoding per step over the window."""
        if not self._steps:
            return 0.0
        return sum(r for _, _, r in self._steps) / (len(self._steps) * num_slots)

    def last_step_at(self) -> float:
        return self._steps[-1][0] if self._steps else 0.0


def log_stats(s: SamplerStats) -> None:
    log.info(
        "sampler %s: %.1f tok/s, %d/%d slots decoding (occupancy %.0f%%), "
        "%d prefilling, %d queued, %d tokens generated, %d prefix tokens reused",
        s.base_model,
        s.tokens_per_s,
        s.running_rows,
        s.num_slots,
        100 * s.occupancy,
        s.prefilling_requests,
        s.queued_requests,
        s.tokens_generated,
        s.prefix_reused_tokens,
    )
