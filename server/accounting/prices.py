"""What usage costs, at the prices the operator sets (``--prices``): per million
tokens trained, sampled and scored, and per device-hour of engine time.

``--prices "trained=1.50,sampled=0.50,scored=0.25,device_hour=2.00"``: any
subset; what is not named costs nothing. Amounts are in the operator's currency
(``currency=EUR``; default USD). No prices: no cost is shown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from treadle.errors import InvalidArgumentError

PRICE_KEYS = ("trained", "sampled", "scored", "device_hour")


@dataclass(frozen=True)
class Prices:
    trained: float = 0.0  # per million tokens trained (forward_backward)
    sampled: float = 0.0  # per million tokens sampled (generated)
    scored: float = 0.0  # per million tokens scored (forward_logprobs)
    device_hour: float = 0.0  # per hour of engine time (compute_s / 3600)
    currency: str = "USD"
    set: bool = False  # whether the operator gave prices at all

    def cost(
        self, tokens_trained: int, tokens_sampled: int, tokens_scored: int, compute_s: float
    ) -> float:
        return (
            tokens_trained * self.trained / 1e6
            + tokens_sampled * self.sampled / 1e6
            + tokens_scored * self.scored / 1e6
            + compute_s / 3600.0 * self.device_hour
        )


def parse_prices(text: str) -> Prices:
    """``trained=1.5,sampled=0.5,scored=0.25,device_hour=2,currency=USD``."""
    if not text.strip():
        return Prices()
    values: dict[str, float] = {}
    currency = "USD"
    for part in text.split(","):
        key, sep, raw = part.strip().partition("=")
        key = key.strip()
        if not sep:
            raise InvalidArgumentError(f"prices: {part.strip()!r} is not key=value")
        if key == "currency":
            currency = raw.strip()[:8] or "USD"
            continue
        if key not in PRICE_KEYS:
            raise InvalidArgumentError(
                f"prices: unknown key {key!r} (expected {', '.join(PRICE_KEYS)}, currency)"
            )
        try:
            value = float(raw)
        except ValueError:
            raise InvalidArgumentError(f"prices: {key}={raw!r} is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise InvalidArgumentError(f"prices: {key} must be a finite number >= 0")
        values[key] = value
    return Prices(currency=currency, set=True, **values)
