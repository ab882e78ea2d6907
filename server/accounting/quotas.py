"""Per-tenant quotas: models, calls in flight, tokens per request, tokens per minute.

Pure bookkeeping with the clock injected (unit-tested without a server). The
servicers ask in two places: ``check_new_model`` before a model is created, and
``begin``/``end`` around every call that reaches the engine. A call over quota
gets RESOURCE_EXHAUSTED; when waiting can help (calls in flight, tokens per
minute) the error carries ``retry_after_s``, which the interceptor sends as the
``treadle-retry-after-s`` trailer and the SDK waits out before retrying. When it
cannot (a request larger than the per-request quota, the model quota), no delay
is given and the SDK does not retry.

Tokens per minute is a token bucket holding at most one minute's worth, shared by
tokens sampled and tokens trained (forward passes with or without backward). A
sample reserves its worst case (``num_samples * max_tokens``) and gives back what
it did not generate when it ends. Everything runs on the server's event loop, so
there are no locks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from treadle.errors import ResourceExhaustedError

#: how long a call turned away for calls in flight is asked to wait
IN_FLIGHT_RETRY_S = 0.25


@dataclass(frozen=True)
class QuotaLimits:
    """A tenant's limits; 0 turns one off."""

    max_models: int = 64
    max_calls_in_flight: int = 256
    max_tokens_per_request: int = 262_144
    tokens_per_minute: int = 20_000_000

    def __post_init__(self) -> None:
        for name in ("max_models", "max_calls_in_flight", "max_tokens_per_request"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0 (0 = unlimited)")
        if self.tokens_per_minute < 0:
            raise ValueError("tokens_per_minute: must be >= 0 (0 = unlimited)")

    def override(self, values: Mapping[str, int | None]) -> QuotaLimits:
        """These limits with a tenant's overrides (None = keep the default)."""
        changes = {k: v for k, v in values.items() if v is not None}
        return replace(self, **changes) if changes else self


class TokenBucket:
    """``rate`` tokens a second, holding at most ``capacity``; may go into debt by one
    large take, which later takes wait out."""

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self.level = capacity
        self.updated = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, tokens: int, now: float) -> float:
        """Take ``tokens`` and answer 0, or take nothing and answer the seconds to wait.
        A take larger than the bucket needs a full bucket (then it goes into debt)."""
        self._refill(now)
        need = min(float(tokens), self.capacity)
        if self.level >= need:
            self.level -= tokens
            return 0.0
        return (need - self.level) / self.rate

    def give(self, tokens: int, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + tokens)

    def spend(self, tokens: int, now: float) -> None:
        """Take ``tokens`` unconditionally (into debt if need be)."""
        self._refill(now)
        self.level -= tokens


@dataclass
class Ticket:
    """A call admitted under a tenant's quota; hand it back with ``Quotas.end``."""

    tenant_id: str
    tokens: int
    open: bool = True


@dataclass
class _TenantState:
    limits: QuotaLimits
    loaded_at: float
    in_flight: int = 0
    bucket: TokenBucket | None = None
    overrides: Mapping[str, int | None] = field(default_factory=dict)


class Quotas:
    """The quotas of every tenant the server has seen.

    ``overrides(tenant_id)`` returns a tenant's own limits (the database's quota
    columns); it is asked again after ``refresh_s``, so an admin's change applies
    within that time without a restart.
    """

    def __init__(
        self,
        defaults: QuotaLimits,
        *,
        overrides: Callable[[str], Mapping[str, int | None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        refresh_s: float = 30.0,
    ) -> None:
        self.defaults = defaults
        self._overrides = overrides
        self._clock = clock
        self.refresh_s = refresh_s
        self._tenants: dict[str, _TenantState] = {}

    # ---- reading ---------------------------------------------------------------------

    def limits(self, tenant_id: str) -> QuotaLimits:
        return self._state(tenant_id).limits

    def in_flight(self, tenant_id: str) -> int:
        state = self._tenants.get(tenant_id)
        return state.in_flight if state else 0

    # ---- checks ----------------------------------------------------------------------

    def check_new_model(self, tenant_id: str, live_models: int) -> None:
        """Before creating a model; ``live_models`` = the tenant's models that count."""
        limit = self.limits(tenant_id).max_models
        if limit and live_models >= limit:
            raise ResourceExhaustedError(
                f"max_models: the tenant has {live_models} models, its quota is {limit}; "
                "delete one to create another"
            )

    def begin(self, tenant_id: str, tokens: int, *, unblocks_others: bool = False) -> Ticket:
        """Admit one call of ``tokens`` tokens (0 for barriers) or raise
        RESOURCE_EXHAUSTED.

        ``unblocks_others``: the call is one the tenant's later, already admitted
        calls wait for (their model's next ``seq_id``). It is admitted whatever the
        calls in flight and the bucket say (the bucket goes into debt), or those
        calls would hold every slot waiting for a call that cannot get one.
        """
        state = self._state(tenant_id)
        limits = state.limits
        if limits.max_tokens_per_request and tokens > limits.max_tokens_per_request:
            raise ResourceExhaustedError(
                f"max_tokens_per_request: the request has {tokens} tokens, the quota is "
                f"{limits.max_tokens_per_request}; split it into smaller requests"
            )
        now = self._clock()
        cap = limits.max_calls_in_flight
        if cap and state.in_flight >= cap and not unblocks_others:
            raise ResourceExhaustedError(
                f"max_calls_in_flight: the tenant has {state.in_flight} calls in flight, "
                f"its quota is {cap}",
                retry_after_s=IN_FLIGHT_RETRY_S,
            )
        bucket = self._bucket(state, now)
        if bucket is not None and tokens:
            if unblocks_others:
                bucket.spend(tokens, now)
            else:
                wait = bucket.take(tokens, now)
                if wait > 0:
                    raise ResourceExhaustedError(
                        f"tokens_per_minute: {tokens} more tokens would exceed the tenant's "
                        f"quota of {limits.tokens_per_minute} tokens a minute",
                        retry_after_s=_round_up(wait),
                    )
        state.in_flight += 1
        return Ticket(tenant_id, tokens)

    def end(self, ticket: Ticket, used_tokens: int | None = None) -> None:
        """The call is over; ``used_tokens`` (if known, e.g. tokens a sample really
        generated) settles the reservation: the rest goes back to the bucket.
        Ending a ticket twice is a no-op."""
        if not ticket.open:
            return
        ticket.open = False
        state = self._tenants.get(ticket.tenant_id)
        if state is None:
            return
        state.in_flight = max(0, state.in_flight - 1)
        if used_tokens is None or used_tokens == ticket.tokens:
            return
        bucket = self._bucket(state, self._clock())
        if bucket is None:
            return
        if used_tokens < ticket.tokens:
            bucket.give(ticket.tokens - used_tokens, self._clock())
        else:
            bucket.spend(used_tokens - ticket.tokens, self._clock())

    # ---- internals -------------------------------------------------------------------

    def _state(self, tenant_id: str) -> _TenantState:
        now = self._clock()
        state = self._tenants.get(tenant_id)
        if state is None or now - state.loaded_at >= self.refresh_s:
            overrides = dict(self._overrides(tenant_id)) if self._overrides else {}
            limits = self.defaults.override(overrides)
            if state is None:
                state = self._tenants[tenant_id] = _TenantState(limits, now)
            else:
                state.limits, state.loaded_at = limits, now
            state.overrides = overrides
        return state

    def _bucket(self, state: _TenantState, now: float) -> TokenBucket | None:
        per_minute = state.limits.tokens_per_minute
        if not per_minute:
            state.bucket = None
            return None
        bucket = state.bucket
        if bucket is None or bucket.capacity != per_minute:
            fresh = TokenBucket(float(per_minute), per_minute / 60.0, now)
            if bucket is not None:  # the quota changed: keep what was spent
                bucket.spend(0, now)
                fresh.level = min(fresh.capacity, bucket.level)
            state.bucket = bucket = fresh
        return bucket


def _round_up(seconds: float) -> float:
    return math.ceil(seconds * 1000) / 1000
