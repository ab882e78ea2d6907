"""A run's curves and usage: the metrics its calls returned (one point per
optimizer step), the client's own (``log_metrics``), and ``GetUsage`` equal to
the sum of what the run's calls report, at the operator's prices."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import treadle
from tests.conftest import make_server
from tests.helpers import char_ids, next_token_datum, tenant_key
from treadle.rl import merge_metrics
from treadle.server.accounting.prices import parse_prices
from treadle.server.embedded import EmbeddedServer

TIMEOUT = 120
PRICES = "trained=2.0,sampled=1.0,scored=0.5,device_hour=3.6,currency=EUR"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[EmbeddedServer]:
    s = make_server(
        tmp_path_factory.mktemp("runs"), {"tiny": tiny_model_dir}, prices=parse_prices(PRICES)
    )
    yield s
    s.stop()


def test_curves_have_one_point_per_step_and_the_logged_metrics(srv: EmbeddedServer) -> None:
    with treadle.ServiceClient(srv.address, api_key=srv.api_key) as service:
        tc = service.create_lora_training_client("tiny", rank=4, seed=0)
        losses, merged = [], []
        for step in range(1, 4):
            fb1 = tc.forward_backward([next_token_datum(char_ids("12+3=15"))])
            fb2 = tc.forward_backward([next_token_datum(char_ids("hello"))])
            tc.optim_step(treadle.AdamParams(learning_rate=1e-2)).result(TIMEOUT)
            losses.append(
                fb1.result(TIMEOUT).metrics["loss:sum"] + fb2.result(TIMEOUT).metrics["loss:sum"]
            )
            merged.append(merge_metrics([fb1.result().metrics, fb2.result().metrics]))
            tc.log_metrics(step, {"reward/mean": step * 0.25, "eval/acc": 1.0 / step})
        tc.log_metrics(3, {"reward/mean": 0.9})  # a second log of a step replaces it
        tc.forward_backward([next_token_datum(char_ids("in progress"))]).result(TIMEOUT)
        srv.flush_records()
        curves = srv.ctx.service.runs.curves(srv.ctx.default_key.tenant_id, tc.model_id)  # type: ignore[union-attr]
        points = srv.ctx.service.runs.metric_points([tc.model_id])  # the session trace's
    loss = curves.steps["loss:sum"]
    assert [s for s, _ in loss] == [1, 2, 3]  # the call after the last step is left out
    assert [v for _, v in loss] == pytest.approx(losses, rel=1e-6)
    assert [s for s, _ in curves.steps["grad_norm:value"]] == [1, 2, 3]
    # a step's other metrics merge as the SDK merges them (token means here)
    assert [v for _, v in curves.steps["entropy:mean"]] == pytest.approx(
        [m["entropy:mean"] for m in merged], rel=1e-6
    )
    assert curves.logged["reward/mean"] == [(1, 0.25), (2, 0.5), (3, 0.9)]
    assert [s for s, _ in curves.logged["eval/acc"]] == [1, 2, 3]
    logged = sorted(
        (p.step, p.value) for p in points if p.seq_id is None and p.name == "reward/mean"
    )
    assert logged == [(1, 0.25), (2, 0.5), (3, 0.9)]
    assert sum(1 for p in points if p.name == "loss:sum") == 3 * 2 + 1  # one per call


def test_log_metrics_refuses_bad_input_and_other_tenants_models(srv: EmbeddedServer) -> None:
    with treadle.ServiceClient(srv.address, api_key=srv.api_key) as service:
        tc = service.create_lora_training_client("tiny", rank=4, seed=0)
        with pytest.raises(treadle.InvalidArgumentError, match="finite"):
            tc.log_metrics(1, {"reward": float("nan")})
        with pytest.raises(treadle.InvalidArgumentError, match="step"):
            tc.log_metrics(-1, {"reward": 1.0})
        with treadle.ServiceClient(srv.address, api_key=tenant_key(srv, "other")) as other:
            stranger = other.create_lora_training_client("tiny", rank=4, seed=0)
            mine = tc.model_id
            stranger.model_id = mine  # another tenant's id: NOT_FOUND, as a missing one
            with pytest.raises(treadle.NotFoundError):
                stranger.log_metrics(1, {"reward": 1.0})
            with pytest.raises(treadle.NotFoundError):
                stranger.get_usage()


def test_usage_is_the_sum_of_the_runs_calls_and_priced(srv: EmbeddedServer) -> None:
    with treadle.ServiceClient(srv.address, api_key=srv.api_key) as service:
        tc = service.create_lora_training_client("tiny", rank=4, seed=1)
        data = [next_token_datum(char_ids("12+3=15")), next_token_datum(char_ids("ab"))]
        trained = sum(len(d.model_input.to_ints()) for d in data)
        for _ in range(2):
            tc.forward_backward(data).result(TIMEOUT)
            tc.optim_step(treadle.AdamParams(learning_rate=1e-2)).result(TIMEOUT)
        scored = len(data[0].model_input.to_ints())
        tc.forward_logprobs(data[:1]).result(TIMEOUT)
        sampler = tc.sync_weights()
        out = sampler.sample(
            char_ids("1+1="), 2, treadle.SamplingParams(max_tokens=5, temperature=1.0)
        ).result(TIMEOUT)
        sampled = sum(len(s.tokens) for s in out.sequences)
        before = tc.get_usage()  # counted, not yet written: read with the pending counts
        srv.flush_records()
        usage = tc.get_usage()
    assert before == usage
    assert usage.tokens_trained == 2 * trained
    assert usage.tokens_scored == scored
    assert usage.tokens_sampled == sampled
    assert usage.calls == 2 + 2 + 1 + 1 + 1  # fb, optim, logprobs, sync, sample
    assert usage.device_s > 0
    prices = parse_prices(PRICES)
    assert usage.currency == "EUR"
    assert usage.cost == pytest.approx(
        prices.cost(usage.tokens_trained, usage.tokens_sampled, usage.tokens_scored, usage.device_s)
    )
    assert usage.cost > 0
