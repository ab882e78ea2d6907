"""The console in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``) driven with selenium. A wrong key is refused; a tenant signs
in, sees the run it trained and not another tenant's, sees the loss chart drawn
with one point per optimizer step and its ``log_metrics`` reward drawn, deletes
a checkpoint through the confirmation page; another tenant's run URL is 404; the
operator sees the worker and the waiting calls of a backlogged tenant.

``TREADLE_CONSOLE_SCREENSHOTS=docs`` writes the screenshots the README shows
(``docs/console-run.png``, ``docs/console-operator.png``); otherwise they go to
the test's temporary directory.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import func, select

import treadle
from tests.conftest import make_server
from tests.helpers import char_ids, next_token_datum, tenant_key
from treadle import _convert
from treadle.common.db import models as db
from treadle.server.embedded import EmbeddedServer
from treadle.v1 import training_pb2, training_pb2_grpc

pytestmark = pytest.mark.slow

TIMEOUT = 120
STEPS = 3
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ROOT = Path(__file__).resolve().parents[3]


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the dev extra)"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            return f"{path} is missing: apt-get install -y chromium chromium-driver"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    reason = _browser_missing()
    if reason and os.environ.get("CI"):  # .ci/run installs them: missing there is a failure
        pytest.fail(reason)
    if reason:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,800",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[EmbeddedServer]:
    s = make_server(
        tmp_path_factory.mktemp("browser"),
        {"tiny": tiny_model_dir},
        http_port=0,
        gap_timeout_s=120.0,
    )
    yield s
    s.stop()


def _shots(tmp_path: Path) -> Path:
    return ROOT / "docs" if os.environ.get("TREADLE_CONSOLE_SCREENSHOTS") == "docs" else tmp_path


def _wait(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except Exception:  # the element is not there yet
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _train(srv: EmbeddedServer, key: str) -> str:
    """A run of STEPS steps, each with the client's reward logged, and two checkpoints."""
    with treadle.ServiceClient(srv.address, api_key=key) as service:
        tc = service.create_lora_training_client("tiny", rank=4, seed=0)
        for step in range(1, STEPS + 1):
            tc.forward_backward([next_token_datum(char_ids("12+3=15"))])
            tc.optim_step(treadle.AdamParams(learning_rate=1e-2)).result(TIMEOUT)
            tc.log_metrics(step, {"reward": 0.2 * step})
        tc.save_state("keep").result(TIMEOUT)
        tc.save_state("drop").result(TIMEOUT)
        return tc.model_id


def _sign_in(driver: Any, base: str, key: str) -> None:
    from selenium.webdriver.common.by import By

    driver.delete_all_cookies()
    driver.get(f"{base}/console/login")
    field = driver.find_element(By.ID, "api_key")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.ID, "sign-in").click()


def test_tenant_pages_in_chromium(browser: Any, srv: EmbeddedServer, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    base = srv.http_url
    assert base is not None
    alice, bob = tenant_key(srv, "alice"), tenant_key(srv, "bob")
    mine, theirs = _train(srv, alice), _train(srv, bob)

    _sign_in(browser, base, "tdl-" + "w" * 43)  # a wrong key
    error = _wait(lambda: browser.find_elements(By.ID, "error"), "the sign-in error")
    assert "not valid" in error[0].text  # (the click returns before the answer is drawn)
    assert browser.get_cookies() == []

    _sign_in(browser, base, alice)
    _wait(lambda: browser.find_elements(By.ID, "runs"), "the runs list")
    assert browser.current_url.endswith("/console/runs")
    links = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "a.run-link")]
    assert links == [mine]  # bob's run is not listed
    cookie = browser.get_cookies()[0]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and alice not in cookie["value"]

    browser.find_element(By.LINK_TEXT, mine).click()
    loss = '#charts figure[data-source="steps"][data-metric="loss:sum"]'
    reward = '#charts figure[data-source="logged"][data-metric="reward"]'
    for selector in (loss, reward):  # drawn: a canvas, one point per step
        _wait(
            lambda s=selector: (
                browser.find_element(By.CSS_SELECTOR, s).get_attribute("data-points") == str(STEPS)
            ),
            selector,
        )
        canvas = browser.find_element(By.CSS_SELECTOR, f"{selector} canvas")
        assert canvas.size["width"] > 100 and canvas.size["height"] > 50
    assert browser.find_element(By.CSS_SELECTOR, "#checkpoints tr[data-name='drop']")
    browser.save_screenshot(str(_shots(tmp_path) / "console-run.png"))

    # the page follows the run: a point logged now is drawn without a reload
    channel = grpc.intercept_channel(grpc.insecure_channel(srv.address), _Bearer(alice))
    training_pb2_grpc.TrainingServiceStub(channel).LogMetrics(
        training_pb2.LogMetricsRequest(model_id=mine, step=STEPS + 1, metrics={"reward": 0.9}),
        timeout=TIMEOUT,
    )
    channel.close()
    _wait(
        lambda: (
            browser.find_element(By.CSS_SELECTOR, reward).get_attribute("data-points")
            == str(STEPS + 1)
        ),
        "the new point, polled",
    )

    # readable on a phone: nothing wider than the screen but the scrolling tables
    browser.set_window_size(390, 844)
    try:
        browser.refresh()
        _wait(lambda: browser.find_element(By.CSS_SELECTOR, f"{loss} canvas"), "the loss chart")
        overflow = browser.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 1, overflow
        chart = browser.find_element(By.CSS_SELECTOR, loss)
        assert chart.size["width"] <= 390
        browser.save_screenshot(str(tmp_path / "console-run-phone.png"))
    finally:
        browser.set_window_size(1280, 800)

    # delete a checkpoint through the confirmation page
    row = browser.find_element(By.CSS_SELECTOR, "#checkpoints tr[data-name='drop']")
    row.find_element(By.LINK_TEXT, "Delete…").click()
    _wait(lambda: browser.find_element(By.ID, "confirm-delete"), "the confirmation")
    browser.find_element(By.ID, "confirm-delete").click()
    _wait(lambda: browser.find_elements(By.ID, "checkpoints"), "the run page again")
    names = [
        tr.get_attribute("data-name")
        for tr in browser.find_elements(By.CSS_SELECTOR, "#checkpoints tr[data-name]")
    ]
    assert names == ["keep"]

    # another tenant's run: the same page as a missing one
    browser.get(f"{base}/console/runs/{theirs}")
    assert browser.find_element(By.ID, "error-title").text == "Not found"
    assert theirs not in browser.page_source.replace(f"/console/runs/{theirs}", "")

    # the operator page is not for a tenant's key
    browser.get(f"{base}/console/operator")
    assert browser.find_element(By.ID, "error-title").text == "Not allowed"

    browser.find_element(By.ID, "sign-out").click()
    _wait(lambda: browser.find_elements(By.ID, "api_key"), "the sign-in page")
    browser.get(f"{base}/console/runs")
    assert browser.find_elements(By.ID, "api_key")  # signed out: asked to sign in


def test_operator_sees_the_worker_and_a_backlogged_tenants_waiting_calls(
    browser: Any, srv: EmbeddedServer, tmp_path: Path
) -> None:
    """Tenant carol's calls 2..4 wait for its missing seq_id 1: admitted, queued,
    not finished, until seq_id 1 arrives."""
    from selenium.webdriver.common.by import By

    base = srv.http_url
    assert base is not None and srv.api_key is not None
    carol = tenant_key(srv, "carol")
    with treadle.ServiceClient(srv.address, api_key=carol) as service:
        model_id = service.create_lora_training_client("tiny", rank=4, seed=0).model_id
    channel = grpc.intercept_channel(grpc.insecure_channel(srv.address), _Bearer(carol))
    stub = training_pb2_grpc.TrainingServiceStub(channel)

    def fb(seq: int) -> Any:
        req = training_pb2.ForwardBackwardRequest(
            model_id=model_id, seq_id=seq, loss_fn=_convert.loss_fn_to_wire("cross_entropy")
        )
        req.data.extend(_convert.datums_to_wire([next_token_datum(char_ids("1+1=2"))]))
        return stub.ForwardBackward.future(req, timeout=TIMEOUT)

    waiting = [fb(seq) for seq in (2, 3, 4)]
    try:
        _sign_in(browser, base, srv.api_key)
        _wait(lambda: browser.find_elements(By.ID, "tenant"), "signed in")

        def queue_row() -> Any:
            browser.get(f"{base}/console/operator")
            row = "#queue tr[data-tenant='carol']"
            in_flight = browser.find_element(By.CSS_SELECTOR, f"{row} .in-flight").text
            waiting = browser.find_element(By.CSS_SELECTOR, f"{row} .waiting").text
            return in_flight == "3" and waiting == "3"  # all three wait in the scheduler

        _wait(queue_row, "carol's three waiting calls")
        # her fair-share deficit: the in-process engine's own figure (she has had no
        # round yet: she earned nothing and owes nothing)
        deficit = browser.find_element(
            By.CSS_SELECTOR, "#queue tr[data-tenant='carol'] .deficit .per-worker"
        )
        assert deficit.get_attribute("data-worker") == "in-process engine"
        assert deficit.text == str(_engine_deficit(srv, carol_id(srv)))
        engine = browser.find_element(
            By.CSS_SELECTOR, "#workers tr[data-worker='in-process engine']"
        )
        assert "tiny" in engine.text
        cell = lambda name: engine.find_element(By.CSS_SELECTOR, f".{name}").text  # noqa: E731
        assert cell("role") == "both" and cell("device") == "cpu"
        size = r"[\d.]+ (B|KiB|MiB|GiB)"
        assert re.fullmatch(rf"{size} used, {size} free of {size}", cell("memory"))
        # every run of this module is a LoRA run the engine holds: as many adapters as
        # the server has models active (its database, not the engine, counts them)
        active = _active_models(srv)
        assert active >= 1 and cell("loaded") == cell("adapters") == str(active)
        tenants = [
            tr.get_attribute("data-tenant")
            for tr in browser.find_elements(By.CSS_SELECTOR, "#tenants tr[data-tenant]")
        ]
        assert {"default", "carol"} <= set(tenants)
        _whole_page_screenshot(browser, _shots(tmp_path) / "console-operator.png")

        browser.set_window_size(390, 844)  # a phone: only the tables scroll sideways
        try:
            browser.refresh()
            _wait(lambda: browser.find_element(By.ID, "queue"), "the queue")
            overflow = browser.execute_script(
                "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
            )
            assert overflow <= 1, overflow
            browser.save_screenshot(str(tmp_path / "console-operator-phone.png"))
        finally:
            browser.set_window_size(1280, 800)
    finally:
        fb(1).result()  # the gap closes: every waiting call runs
        for f in waiting:
            f.result()
        channel.close()


def _whole_page_screenshot(driver: Any, path: Path) -> None:
    """The page at 1280 px wide, as tall as it is (the queue is below an 800 px fold)."""
    chrome = driver.execute_script("return window.outerHeight - window.innerHeight")
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, max(800, height + chrome))
    try:
        driver.save_screenshot(str(path))
    finally:
        driver.set_window_size(1280, 800)


def carol_id(srv: EmbeddedServer) -> str:
    assert srv.ctx is not None
    with srv.ctx.sessions() as s:
        return str(s.scalars(select(db.Tenant.id).where(db.Tenant.name == "carol")).one())


def _active_models(srv: EmbeddedServer) -> int:
    assert srv.ctx is not None
    with srv.ctx.sessions() as s:
        return int(s.scalar(select(func.count()).where(db.Model.status == "active")) or 0)


def _engine_deficit(srv: EmbeddedServer, tenant_id: str) -> int:
    """The tenant's deficit as the in-process engine reports it now."""
    assert srv.ctx is not None
    report = srv.ctx.engine_metrics.engine_report()
    assert report is not None
    [q] = [q for q in report.queue if q.tenant_id == tenant_id]
    return q.deficit


class _Bearer(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, key: str) -> None:
        self.key = key

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {self.key}")]
        return continuation(details._replace(metadata=metadata), request)
