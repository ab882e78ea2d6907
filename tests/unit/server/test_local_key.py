"""A client with no key finds the key of a server on this machine, and only of one."""

from __future__ import annotations

from pathlib import Path

import pytest

from treadle._local_key import is_loopback, local_api_key


@pytest.mark.parametrize(
    "address",
    ["localhost:50051", "127.0.0.1:50051", "127.0.0.2:1", "[::1]:50051", "ipv4:127.0.0.1:5"],
)
def test_loopback_addresses(address: str) -> None:
    assert is_loopback(address)


@pytest.mark.parametrize(
    "address", ["treadle.internal:50051", "10.0.0.5:50051", "[2001:db8::1]:50051", "example.com"]
)
def test_other_hosts_are_not_loopback(address: str) -> None:
    assert not is_loopback(address)


def test_reads_the_data_dirs_key_for_loopback_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TREADLE_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert local_api_key("localhost:50051") is None  # no file: no key
    (tmp_path / "treadle-data").mkdir()
    (tmp_path / "treadle-data" / "api_key").write_text("tdl-abc\n")
    assert local_api_key("localhost:50051") == "tdl-abc"
    assert local_api_key("treadle.internal:50051") is None  # never sent elsewhere
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "api_key").write_text("tdl-xyz\n")
    monkeypatch.setenv("TREADLE_DATA_DIR", str(other))
    assert local_api_key("127.0.0.1:50051") == "tdl-xyz"
