"""Quotas: pure, with a fake clock."""

from __future__ import annotations

import pytest

from treadle.errors import ResourceExhaustedError
from treadle.server.accounting.quotas import IN_FLIGHT_RETRY_S, QuotaLimits, Quotas, TokenBucket


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def quotas(clock: Clock, **limits: int) -> Quotas:
    return Quotas(QuotaLimits(**limits), clock=clock)


def test_calls_in_flight_are_capped_and_released() -> None:
    clock = Clock()
    q = quotas(clock, max_calls_in_flight=2, tokens_per_minute=0)
    a = q.begin("t", 10)
    q.begin("t", 10)
    with pytest.raises(ResourceExhaustedError, match="max_calls_in_flight") as info:
        q.begin("t", 10)
    assert info.value.retry_after_s == IN_FLIGHT_RETRY_S
    q.begin("other", 10)  # another tenant's calls are not counted against this one
    q.end(a)
    q.end(a)  # twice: a no-op, not a second release
    assert q.in_flight("t") == 1
    q.begin("t", 10)
    assert q.in_flight("t") == 2


def test_a_call_that_unblocks_others_is_always_admitted() -> None:
    clock = Clock()
    q = quotas(clock, max_calls_in_flight=1, tokens_per_minute=60)
    q.begin("t", 60)  # seq 2 got in first and waits for seq 1
    ticket = q.begin("t", 60, unblocks_others=True)  # seq 1: admitted, bucket into debt
    assert q.in_flight("t") == 2
    q.end(ticket)
    with pytest.raises(ResourceExhaustedError) as info:
        q.begin("t", 1)
    assert info.value.retry_after_s is not None


def test_tokens_per_request() -> None:
    q = quotas(Clock(), max_tokens_per_request=100)
    q.begin("t", 100)
    with pytest.raises(ResourceExhaustedError, match="max_tokens_per_request") as info:
        q.begin("t", 101)
    assert info.value.retry_after_s is None  # waiting cannot help: no retry
    assert q.in_flight("t") == 1


def test_tokens_per_minute_bucket_says_when_to_retry() -> None:
    clock = Clock()
    q = quotas(clock, tokens_per_minute=600)  # 10 tokens a second
    for _ in range(6):
        q.end(q.begin("t", 100))
    with pytest.raises(ResourceExhaustedError, match="tokens_per_minute") as info:
        q.begin("t", 50)
    assert info.value.retry_after_s == pytest.approx(5.0)
    assert q.in_flight("t") == 0  # a refused call holds nothing
    clock.t += 4.9
    with pytest.raises(ResourceExhaustedError):
        q.begin("t", 50)
    clock.t += 0.1
    q.begin("t", 50)
    q.begin("u", 600)  # tenants have their own buckets


def test_sample_reservation_is_settled_with_what_was_used() -> None:
    clock = Clock()
    q = quotas(clock, tokens_per_minute=1000)
    ticket = q.begin("t", 800)  # reserve the worst case
    q.end(ticket, used_tokens=100)  # generated far fewer
    q.begin("t", 900)  # the 700 unused came back
    with pytest.raises(ResourceExhaustedError):
        q.begin("t", 1)


def test_more_used_than_reserved_is_charged() -> None:
    clock = Clock()
    q = quotas(clock, tokens_per_minute=1000)
    q.end(q.begin("t", 100), used_tokens=1000)
    with pytest.raises(ResourceExhaustedError):
        q.begin("t", 1)


def test_a_request_larger_than_the_bucket_needs_a_full_bucket_then_goes_into_debt() -> None:
    clock = Clock()
    b = TokenBucket(capacity=100, rate=10, now=clock.t)
    assert b.take(250, clock.t) == 0.0  # full bucket: admitted, 150 in debt
    assert b.take(10, clock.t) == pytest.approx(16.0)  # (10 - -150) / 10
    clock.t += 16
    assert b.take(10, clock.t) == 0.0


def test_zero_turns_a_quota_off() -> None:
    q = quotas(
        Clock(), max_models=0, max_calls_in_flight=0, max_tokens_per_request=0, tokens_per_minute=0
    )
    for _ in range(1000):
        q.begin("t", 10**9)
    q.check_new_model("t", 10**6)


def test_model_quota() -> None:
    q = quotas(Clock(), max_models=2)
    q.check_new_model("t", 1)
    with pytest.raises(ResourceExhaustedError, match="max_models") as info:
        q.check_new_model("t", 2)
    assert info.value.retry_after_s is None


def test_overrides_per_tenant_are_reloaded_after_refresh() -> None:
    clock = Clock()
    table: dict[str, dict[str, int | None]] = {"vip": {"max_models": 10, "tokens_per_minute": None}}
    asked: list[str] = []

    def overrides(tenant: str) -> dict[str, int | None]:
        asked.append(tenant)
        return table.get(tenant, {})

    q = Quotas(QuotaLimits(max_models=2), overrides=overrides, clock=clock, refresh_s=30)
    assert q.limits("vip").max_models == 10
    assert q.limits("vip").tokens_per_minute == QuotaLimits().tokens_per_minute
    assert q.limits("plain").max_models == 2
    table["vip"]["max_models"] = 1
    assert q.limits("vip").max_models == 10  # cached
    clock.t += 30
    assert q.limits("vip").max_models == 1
    assert asked.count("vip") == 2


def test_a_changed_rate_keeps_what_was_spent() -> None:
    clock = Clock()
    table: dict[str, dict[str, int | None]] = {"t": {"tokens_per_minute": 1000}}
    q = Quotas(QuotaLimits(), overrides=lambda t: table[t], clock=clock, refresh_s=1)
    q.end(q.begin("t", 1000))
    table["t"]["tokens_per_minute"] = 2000
    clock.t += 1  # refilled 1000 / 60 * 1 tokens meanwhile
    with pytest.raises(ResourceExhaustedError):
        q.begin("t", 1000)


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_models"):
        QuotaLimits(max_models=-1)
