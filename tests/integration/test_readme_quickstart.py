"""The README's SDK quickstart runs as written (against a test server and the tiny model)."""

from __future__ import annotations

import re
from pathlib import Path

from treadle.server.embedded import EmbeddedServer

README = Path(__file__).resolve().parents[2] / "README.md"


def quickstart_source() -> str:
    text = README.read_text()
    section = text.split("## SDK quickstart", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README lost its quickstart code block"
    return match.group(1)


def test_readme_quickstart_runs(server: EmbeddedServer, monkeypatch, capsys) -> None:  # noqa: ANN001
    source = quickstart_source()
    assert 'ServiceClient("localhost:50051")' in source
    source = source.replace('"localhost:50051"', repr(server.address))
    source = source.replace('"demo"', '"tiny"').replace("range(20)", "range(2)")
    key = getattr(server, "api_key", None)
    if key:
        monkeypatch.setenv("TREADLE_API_KEY", key)
    exec(compile(source, str(README), "exec"), {"__name__": "quickstart"})
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert len(lines) == 2
    step, reward, loss, opt_step = lines[-1].split()
    assert (int(step), int(opt_step)) == (1, 2)
    assert 0.0 <= float(reward) <= 1.0
