"""S3Store against a real S3 server (moto_server on loopback): multipart uploads,
round trips bit for bit, replacement, deletion, and missing checkpoints."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.services import moto_s3
from treadle.common.s3_store import PART_BYTES, S3Store
from treadle.common.store import make_store
from treadle.errors import InvalidArgumentError, NotFoundError
from treadle.workers.trainer.checkpoint import FORMAT


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_s3("ckpts") as url:
        yield url


def _write_checkpoint(directory: Path, big: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "weights.safetensors").write_bytes(big)
    (directory / "optimizer.safetensors").write_bytes(b"opt" * 100)
    (directory / "manifest.json").write_text(json.dumps({"format": FORMAT, "step": 3}))


def test_round_trip_with_multipart(endpoint: str, tmp_path: Path) -> None:
    store = make_store(
        "s3://ckpts/runs/a", local_root=tmp_path, endpoint_url=endpoint, staging=tmp_path / "stage"
    )
    assert isinstance(store, S3Store) and not store.is_local
    path = store.state_path("t-1", "m-1", "step3")
    assert path == "s3://ckpts/runs/a/t-1/m-1/step3"
    big = os.urandom(2 * PART_BYTES + 12345)  # three multipart parts
    local = store.staging_dir(path)
    _write_checkpoint(local, big)
    size = sum(f.stat().st_size for f in local.iterdir())
    assert store.commit(local, path) == size
    assert not local.exists()  # the staged copy is freed once uploaded
    head = store.client.head_object(Bucket="ckpts", Key="runs/a/t-1/m-1/step3/weights.safetensors")
    assert "-" in head["ETag"]  # a multipart ETag: <md5>-<parts>
    fetched = store.fetch(path)
    assert (fetched / "weights.safetensors").read_bytes() == big
    assert store.read_manifest(path)["step"] == 3
    store.release(fetched, path)
    assert not fetched.exists()


def test_save_again_replaces_and_delete_removes(endpoint: str, tmp_path: Path) -> None:
    store = S3Store("s3://ckpts", endpoint_url=endpoint, staging=tmp_path)
    path = store.state_path("t", "m", "a")
    first = store.staging_dir(path)
    _write_checkpoint(first, b"one")
    (first / "adapter_config.json").write_text("{}")
    store.commit(first, path)
    second = store.staging_dir(path)
    _write_checkpoint(second, b"two")
    store.commit(second, path)
    fetched = store.fetch(path)
    assert sorted(p.name for p in fetched.iterdir()) == [
        "manifest.json",
        "optimizer.safetensors",
        "weights.safetensors",
    ]
    assert (fetched / "weights.safetensors").read_bytes() == b"two"
    store.delete(path)
    with pytest.raises(NotFoundError):
        store.fetch(path)
    with pytest.raises(NotFoundError):
        store.read_manifest(path)


def test_bad_bucket_and_foreign_paths(endpoint: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="cannot reach bucket"):
        S3Store("s3://no-such-bucket/x", endpoint_url=endpoint, staging=tmp_path)
    with pytest.raises(InvalidArgumentError, match="s3://bucket"):
        S3Store("s3:///nobucket", endpoint_url=endpoint, staging=tmp_path)
    store = S3Store("s3://ckpts/p", endpoint_url=endpoint, staging=tmp_path)
    with pytest.raises(NotFoundError):
        store.fetch("s3://other-bucket/p/t/m/a")
