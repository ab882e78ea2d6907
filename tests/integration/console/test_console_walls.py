"""The console's walls over plain HTTP: sign-in makes an HttpOnly SameSite=Strict
cookie and the key appears nowhere after; a bad, forged or expired cookie is 401;
a forged CSRF token is 403 and changes nothing; another tenant's run, checkpoint
or download, and a ``..`` path, answer 404 like a missing one; a tenant's key
never sees the operator page; GetUsage over HTTP agrees with gRPC."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import delete, select

import treadle
from tests.conftest import make_server
from tests.helpers import char_ids, next_token_datum, tenant_key
from treadle.common.db import models as db
from treadle.common.db import workers as wq
from treadle.common.engine.domain import TenantQueue
from treadle.common.engine.report import EngineReport, MemoryReading
from treadle.server.console.cookies import COOKIE
from treadle.server.embedded import EmbeddedServer

TIMEOUT = 120


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[EmbeddedServer]:
    s = make_server(tmp_path_factory.mktemp("console"), {"tiny": tiny_model_dir}, http_port=0)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def runs(srv: EmbeddedServer) -> dict[str, object]:
    """A run of tenant "alice" with a checkpoint, and one of tenant "bob"."""
    alice, bob = tenant_key(srv, "alice"), tenant_key(srv, "bob")
    out: dict[str, object] = {"alice_key": alice, "bob_key": bob}
    for who, key in (("alice", alice), ("bob", bob)):
        with treadle.ServiceClient(srv.address, api_key=key) as service:
            tc = service.create_lora_training_client("tiny", rank=4, seed=0)
            tc.forward_backward([next_token_datum(char_ids("12+3=15"))])
            tc.optim_step(treadle.AdamParams(learning_rate=1e-2)).result(TIMEOUT)
            tc.save_state("first").result(TIMEOUT)
            out[who] = tc.model_id
            out[f"{who}_session"] = tc.get_info().session_id
            assert out[f"{who}_session"]
            out[f"{who}_usage"] = tc.get_usage()
    return out


def _client(srv: EmbeddedServer) -> httpx.Client:
    assert srv.http_url is not None
    return httpx.Client(base_url=srv.http_url, follow_redirects=False, timeout=60)


@contextlib.contextmanager
def _sign_in(srv: EmbeddedServer, key: str) -> Iterator[httpx.Client]:
    with _client(srv) as c:
        r = c.post("/console/login", data={"api_key": key})
        assert r.status_code == 303, r.text
        yield c


def _csrf(html: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', html)
    assert m is not None
    return m.group(1)


def test_sign_in_sets_a_strict_httponly_cookie_and_the_key_appears_nowhere(
    srv: EmbeddedServer, runs: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    key = str(runs["alice_key"])
    wrong = "tdl-" + "k" * 43
    with _client(srv) as c:
        assert c.post("/console/login", data={"api_key": wrong}).status_code == 401
        r = c.post("/console/login", data={"api_key": key})
        assert r.status_code == 303 and r.headers["location"] == "/console/runs"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
        assert key not in cookie and key[4:20] not in cookie
        page = c.get("/console/runs")
        assert page.status_code == 200
        assert str(runs["alice"]) in page.text and str(runs["bob"]) not in page.text
        assert key not in page.text
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        run = c.get(f"/console/runs/{runs['alice']}")
        assert run.status_code == 200 and key not in run.text
        trace_url = re.search(r'id="trace" href="([^"]+)"', run.text)
        assert trace_url is not None
        trace = c.get(trace_url.group(1))
        assert trace.status_code == 200 and "attachment" in trace.headers["content-disposition"]
        tracks = [e["args"]["name"] for e in trace.json()["traceEvents"] if e["ph"] == "M"]
        assert f"training run {runs['alice']}" in tracks
    assert "sign-in was refused" in caplog.text  # the refusal is logged...
    for secret in (key, wrong, key[4:16], wrong[4:16]):  # ...and no key, nor a piece of one
        assert secret not in caplog.text


def test_wrong_key_and_bad_cookies_are_refused(
    srv: EmbeddedServer, runs: dict[str, object]
) -> None:
    for origin in ("http://evil.example", "null"):  # a sign-in posted from another site
        with _client(srv) as c:
            r = c.post(
                "/console/login",
                data={"api_key": str(runs["alice_key"])},
                headers={"Origin": origin},
            )
            assert r.status_code == 403 and c.cookies.get(COOKIE) is None
    with _client(srv) as c:
        r = c.post("/console/login", data={"api_key": "tdl-" + "x" * 43})
        assert r.status_code == 401 and "not valid" in r.text
        assert c.cookies.get(COOKIE) is None
        assert c.get("/console/runs").status_code == 401  # no cookie
        for bad in ("garbage", "a.b", "eyJ0IjoidCJ9.AAAA", "x" * 2000):
            c.cookies.set(COOKIE, bad, path="/console")
            assert c.get("/console/runs").status_code == 401
    with _sign_in(srv, str(runs["alice_key"])) as c:
        good = c.cookies.get(COOKIE)
        assert good is not None
        body, mac = good.split(".")
        forged = body[:-2] + ("AA" if body[-2:] != "AA" else "BB") + "." + mac
        c.cookies.set(COOKIE, forged, path="/console")
        assert c.get("/console/runs").status_code == 401


def test_an_expired_cookie_is_refused(srv: EmbeddedServer, runs: dict[str, object]) -> None:
    from treadle.server.console.cookies import CookieSigner, load_secret

    signer = CookieSigner(load_secret(srv.config.data_dir))
    with _sign_in(srv, str(runs["alice_key"])) as c:
        session = signer.read(c.cookies.get(COOKIE))
        assert session is not None
        old, _ = signer.issue(session.tenant_id, session.key_id, now=0.0)  # expired in 1970
        c.cookies.set(COOKIE, old, path="/console")
        assert c.get("/console/runs").status_code == 401


def test_other_tenants_ids_and_dotdot_paths_are_404(
    srv: EmbeddedServer, runs: dict[str, object]
) -> None:
    bob = runs["bob"]
    with _sign_in(srv, str(runs["alice_key"])) as c:
        missing = c.get("/console/runs/m-0000000000000000")
        for path in (
            f"/console/runs/{bob}",
            f"/console/runs/{bob}/curves",
            f"/console/runs/{bob}/usage",
            f"/console/runs/{bob}/checkpoints/first/delete",
            f"/console/runs/{bob}/checkpoints/first/download",
            f"/console/sessions/{runs['bob_session']}/trace",
            f"/console/runs/{runs['alice']}/checkpoints/..%2F..%2Fapi_key/download",
            f"/console/runs/{runs['alice']}/checkpoints/../download",
            "/console/runs/%2E%2E",
            f"/console/runs/{runs['alice']}/checkpoints/%2E%2E/download",
            "/console/static/..%2F..%2Froutes.py",
        ):
            r = c.get(path)
            assert r.status_code == 404, (path, r.status_code)
            assert str(bob) not in r.text
        assert missing.status_code == 404
        csrf = _csrf(c.get(f"/console/runs/{runs['alice']}").text)
        r = c.post(f"/console/runs/{bob}/checkpoints/first/delete", data={"csrf": csrf})
        assert r.status_code == 404
    with _sign_in(srv, str(runs["bob_key"])) as c:  # bob's checkpoint is still there
        assert 'data-name="first"' in c.get(f"/console/runs/{bob}").text


def test_forged_csrf_changes_nothing_and_a_real_one_deletes(
    srv: EmbeddedServer, runs: dict[str, object]
) -> None:
    alice = runs["alice"]
    with _sign_in(srv, str(runs["alice_key"])) as c:
        url = f"/console/runs/{alice}/checkpoints/first/delete"
        confirm = c.get(url)
        assert confirm.status_code == 200 and "cannot be undone" in confirm.text
        assert c.post(url, data={"csrf": "forged"}).status_code == 403
        assert c.post(url, data={}).status_code == 403
        assert "first" in c.get(f"/console/runs/{alice}").text
        dl = c.get(f"/console/runs/{alice}/checkpoints/first/download")
        assert dl.status_code == 200 and dl.headers["content-type"] == "application/x-tar"
        assert len(dl.content) > 1024
        r = c.post(url, data={"csrf": _csrf(confirm.text)})
        assert r.status_code == 303
        assert 'data-name="first"' not in c.get(f"/console/runs/{alice}").text
        # sign-out needs the token too, and then the cookie is gone
        assert c.post("/console/logout", data={"csrf": "forged"}).status_code == 403
        out = c.post("/console/logout", data={"csrf": _csrf(confirm.text)})
        assert out.status_code == 303 and out.headers["location"] == "/console/login"
        assert c.get("/console/runs").status_code == 401


def test_operator_page_is_the_admin_tenants_only(
    srv: EmbeddedServer, runs: dict[str, object]
) -> None:
    with _sign_in(srv, str(runs["alice_key"])) as c:
        r = c.get("/console/operator")
        assert r.status_code == 403 and "bob" not in r.text
        assert "Operator" not in c.get("/console/runs").text
    assert srv.api_key is not None and srv.ctx is not None
    with srv.ctx.sessions() as s:  # a `treadle worker` as a distributed server sees it
        s.add(
            db.Worker(
                id="gpu-host-1:0",
                hostname="gpu-host-1",
                base_models='["tiny"]',
                capacity=8,
                status="draining",
                role="sampler",
            )
        )
        # two workers report with their heartbeats: bob's calls wait on both, and
        # each has its own scheduler, so its own deficit for him
        wq.register_worker(
            s, "gpu-host-2:0", hostname="gpu-host-2", base_models=["tiny"], capacity=8
        )
        bob = s.scalars(select(db.Tenant.id).where(db.Tenant.name == "bob")).one()
        for worker_id, report in (
            ("gpu-host-1:0", _report(bob, waiting=2, deficit=-250, served=1)),
            ("gpu-host-2:0", _report(bob, waiting=1, deficit=120, served=0)),
            ("gpu-host-3:0", _report(bob, waiting=5, deficit=7, served=0)),
        ):
            if worker_id == "gpu-host-3:0":
                wq.register_worker(
                    s, worker_id, hostname="gpu-host-3", base_models=["tiny"], capacity=8
                )
            assert wq.heartbeat(s, worker_id, report) in wq.SERVING
        wq.set_worker_status(s, "gpu-host-3:0", "dead")  # its last report is no queue now
        s.commit()
    try:
        with _sign_in(srv, srv.api_key) as c:
            r = c.get("/console/operator")
    finally:
        with srv.ctx.sessions() as s:  # gone again: the other tests see the engine alone
            s.execute(delete(db.Worker).where(db.Worker.id.like("gpu-host-%")))
            s.commit()
    assert r.status_code == 200
    assert 'data-tenant="alice"' in r.text and 'data-tenant="bob"' in r.text
    assert "in-process engine" in r.text
    row = _row(r.text, 'data-worker="gpu-host-1:0"')
    assert "gpu-host-1" in row and "draining" in row and "tiny" in row
    assert '<td class="role">sampler</td>' in row  # its role (`treadle worker --role`)
    assert '<td class="device">cuda:1</td>' in row
    assert '<td class="memory">3.0 GiB used, 60.0 GiB free of 80.0 GiB</td>' in row
    assert re.search(r'class="loaded">3 <span class="muted">\(0 placed\)</span>', row)
    assert re.search(r'class="adapters">2 <span class="muted">\+ 1 served</span>', row)
    dead = _row(r.text, 'data-worker="gpu-host-3:0"')
    assert "dead" in dead and '<td class="device"></td>' in dead
    queue = _row(r.text, '<tr data-tenant="bob"><td>bob</td><td class="in-flight">')
    assert '<td class="waiting">3</td>' in queue and '<td class="running">0</td>' in queue
    deficits = re.findall(r'data-worker="([^"]+)">([^<]+)</span>', queue)
    assert deficits == [
        ("gpu-host-1:0", "gpu-host-1:0: -250"),
        ("gpu-host-2:0", "gpu-host-2:0: 120"),
    ]
    assert srv.api_key not in r.text and str(runs["alice_key"]) not in r.text


def _report(tenant_id: str, *, waiting: int, deficit: int, served: int) -> EngineReport:
    return EngineReport(
        device="cuda:1",
        memory=MemoryReading(used_bytes=3 << 30, free_bytes=60 << 30, total_bytes=80 << 30),
        models=3,
        adapters=2,
        served=served,
        queue=(TenantQueue(tenant_id, waiting, 0, deficit),),
    )


def _row(html: str, start: str) -> str:
    return html.split(start, 1)[1].split("</tr>", 1)[0]


def test_usage_over_http_agrees_with_grpc_and_the_page(
    srv: EmbeddedServer, runs: dict[str, object]
) -> None:
    with treadle.ServiceClient(srv.address, api_key=str(runs["alice_key"])) as service:
        tc = service.create_lora_training_client("tiny", rank=4, seed=3)
        tc.forward_backward([next_token_datum(char_ids("hello"))]).result(TIMEOUT)
        grpc_usage = tc.get_usage()
    with _client(srv) as c:
        headers = {"X-API-Key": "tml-" + str(runs["alice_key"])}
        r = c.get(f"/api/v1/training_runs/{tc.model_id}/usage", headers=headers)
        assert r.status_code == 200
        body = r.json()
        assert body["tokens_trained"] == grpc_usage.tokens_trained > 0
        assert body["calls"] == grpc_usage.calls == 1
        other = c.get(f"/api/v1/training_runs/{runs['bob']}/usage", headers=headers)
        assert other.status_code == 404
    with _sign_in(srv, str(runs["alice_key"])) as c:
        page = c.get(f"/console/runs/{tc.model_id}").text
        assert f'id="usage-trained">{grpc_usage.tokens_trained}<' in page
        assert f'id="usage-calls">{grpc_usage.calls}<' in page
        assert c.get(f"/console/runs/{tc.model_id}/usage").json()["tokens_trained"] == (
            grpc_usage.tokens_trained
        )
