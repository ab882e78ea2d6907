"""Two ``treadle serve`` processes side by side on one host: each one's HTTP API
defaults to its own gRPC ``--port`` + 1, so both come up, and each says where at
start-up; an HTTP port that is taken is one line naming ``--http-port``, exit 2."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.integration.serve_process import ServeProcess, free_port_pair

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_servers_on_different_ports_both_come_up(tmp_path: Path, tiny_model_dir: Path) -> None:
    a_port, b_port = free_port_pair(), free_port_pair()
    a = ServeProcess(tmp_path, tiny_model_dir, "--port", str(a_port), name="a")
    b = ServeProcess(tmp_path, tiny_model_dir, "--port", str(b_port), name="b")
    try:
        a_url, a_key = a.wait_serving()
        b_url, b_key = b.wait_serving()
        assert a_url == f"http://127.0.0.1:{a_port + 1}"
        assert b_url == f"http://127.0.0.1:{b_port + 1}"
        for url, key in ((a_url, a_key), (b_url, b_key)):
            r = httpx.get(
                f"{url}/api/v1/get_server_capabilities",
                headers={"X-API-Key": "tml-" + key},
                timeout=30,
            )
            assert r.status_code == 200, r.text
        # a third on A's HTTP port: one line naming the flag, exit status 2
        c_port = free_port_pair()
        c = ServeProcess(
            tmp_path,
            tiny_model_dir,
            *("--port", str(c_port), "--http-port", str(a_port + 1)),
            name="c",
        )
        assert c.proc.wait(240) == 2, c.output()
        lines = [line for line in c.output().splitlines() if "--http-port" in line]
        assert len(lines) == 1, c.output()
        assert f"127.0.0.1:{a_port + 1}" in lines[0] and "Traceback" not in c.output()
    finally:
        a.stop()
        b.stop()
