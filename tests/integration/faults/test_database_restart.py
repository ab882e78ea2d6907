"""PostgreSQL restarted under load, for real: a server on a PostgreSQL of this
test alone (``initdb`` + ``pg_ctl`` on a free port; the shared one is never
touched), three clients training their own models without pause. The database
stops (fast shutdown: every connection cut) for a few seconds, then starts again.

What the clients see: calls during the outage fail UNAVAILABLE (retryable; the
SDK retries are off here so that every failure shows), never INTERNAL or UNKNOWN;
once the database is back, every call succeeds. What is lost: nothing
acknowledged, nothing applied twice: each failed training call is sent again by
the SDK, with its seq_id, before the model's next call, so each model's optimizer
step equals the number of ``optim_step`` calls its client made, and the ops log
holds every seq_id once, all ``done``; the models' rows say the same step."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

import treadle
from tests.integration.distributed.cluster import create_tenant, datum
from tests.integration.private_postgres import PrivatePostgres
from treadle.errors import UnavailableError
from treadle.server.config import ServerConfig
from treadle.server.embedded import EmbeddedServer

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]

CLIENTS = 3
OUTAGE_S = 4.0


@pytest.fixture
def postgres() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres()
    try:
        pg.start()
        yield pg
    finally:
        pg.close()


@dataclass
class Trainer:
    """One client's loop and what it saw: (start, end, rpc, error or None) per call."""

    tc: treadle.TrainingClient
    calls: list[tuple[float, float, str, BaseException | None]] = field(default_factory=list)
    optim_steps: int = 0  # optim_step calls made, whatever their first answer
    last_step: int = 0  # the step the last successful optim_step answered

    def run(self, stop: threading.Event) -> None:
        data = [datum([5, 9, 13, 17, 21, 25, 29])]
        adam = treadle.AdamParams(learning_rate=1e-2)
        while not stop.is_set():
            for rpc in ("forward_backward", "optim_step", "forward_logprobs", "get_info"):
                t0 = time.monotonic()
                error: BaseException | None = None
                try:
                    if rpc == "forward_backward":
                        self.tc.forward_backward(data, "cross_entropy").result(timeout=60)
                    elif rpc == "optim_step":
                        self.optim_steps += 1
                        self.last_step = self.tc.optim_step(adam).result(timeout=60).step
                    elif rpc == "forward_logprobs":
                        self.tc.forward_logprobs(data).result(timeout=60)
                    else:
                        self.tc.get_info()
                except Exception as err:  # any failure shows in the asserts
                    error = err
                self.calls.append((t0, time.monotonic(), rpc, error))
                time.sleep(0.05)


def test_postgres_restarted_under_load(
    postgres: PrivatePostgres, tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = ServerConfig(
        data_dir=tmp_path / "server",
        models={"tiny": tiny_model_dir},
        port=0,
        threads=1,
        database_url=postgres.url,
    )
    server = EmbeddedServer(config).start()
    clients: list[treadle.ServiceClient] = []
    try:
        key = create_tenant(postgres.url, "alice")
        trainers = []
        for i in range(CLIENTS):
            client = treadle.ServiceClient(server.address, api_key=key, max_retries=0)
            clients.append(client)
            trainers.append(Trainer(client.create_lora_training_client("tiny", rank=2, seed=i)))
        stop = threading.Event()
        threads = [threading.Thread(target=t.run, args=(stop,)) for t in trainers]
        for th in threads:
            th.start()
        time.sleep(3.0)  # training under way
        down = time.monotonic()
        postgres.stop()
        time.sleep(OUTAGE_S)
        postgres.start()
        up = time.monotonic()
        time.sleep(8.0)  # training goes on
        stop.set()
        for th in threads:
            th.join(120)
        assert not any(th.is_alive() for th in threads)

        failed = [(rpc, err) for t in trainers for _, _, rpc, err in t.calls if err is not None]
        assert failed, "no call failed: the outage missed the load"
        wrong = [(rpc, repr(err)) for rpc, err in failed if not isinstance(err, UnavailableError)]
        assert wrong == [], wrong
        for t in trainers:
            # every failure fell in the outage (or a call that started before it)
            late = [(rpc, e) for t0, _, rpc, e in t.calls if e is not None and t0 > up + 1.0]
            assert late == [], late
            assert any(t0 < down and e is None for t0, _, _, e in t.calls)
            after = [e for t0, _, _, e in t.calls if t0 > up + 1.0]
            assert len(after) >= 4 and all(e is None for e in after)
            # each optim_step applied once, the failed ones by the SDK's repeat
            info = t.tc.get_info()
            assert t.last_step == t.optim_steps == info.version, (t.optim_steps, info)

        # the rows: every seq_id once and done, each model's step as the clients saw it
        engine = create_engine(postgres.url)
        try:
            with engine.connect() as conn:
                for t in trainers:
                    ops = conn.execute(
                        text("SELECT seq_id, status FROM ops WHERE model_id = :m ORDER BY seq_id"),
                        {"m": t.tc.model_id},
                    ).all()
                    ordered = sum(1 for c in t.calls if c[2] != "get_info")
                    assert [s for s, _ in ops] == list(range(1, ordered + 1))
                    assert {st for _, st in ops} == {"done"}, ops
                    row = conn.execute(
                        text("SELECT status, version FROM models WHERE id = :m"),
                        {"m": t.tc.model_id},
                    ).one()
                    assert tuple(row) == ("active", t.optim_steps)
        finally:
            engine.dispose()
        print(f"\n{len(failed)} calls failed UNAVAILABLE during a {OUTAGE_S:g} s outage")
    finally:
        for client in clients:
            client.close()
        server.stop()
