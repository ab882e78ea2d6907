"""Checkpoints in S3 (or any S3-compatible store: MinIO, Ceph, moto), through boto3.

A checkpoint directory becomes the objects ``<prefix>/<tenant>/<model_id>/<name>/<file>``
of one bucket; its storage path is ``s3://bucket/<prefix>/<tenant>/<model_id>/<name>``.
Engines write into and read from a local staging directory; this class moves the
files. Large files go up and down in parallel multipart pieces of ``PART_BYTES``
(S3's floor for a part is 5 MiB, and moto enforces it).
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

from treadle.common.store import storage_path_str
from treadle.errors import InvalidArgumentError, NotFoundError, UnavailableError

PART_BYTES = 8 * 1024 * 1024
MANIFEST = "manifest.json"


def parse_s3_url(url: str, field: str = "store") -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (bucket, "some/prefix")."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise InvalidArgumentError(f"{field}: {url!r} is not an s3://bucket[/prefix] URL")
    return parsed.netloc, parsed.path.strip("/")


class S3Store:
    is_local = False

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        staging: Path | None = None,
        check: bool = True,
    ) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = url
        self.local_root = Path(staging or tempfile.mkdtemp(prefix="treadle-staging-"))
        self.local_root.mkdir(parents=True, exist_ok=True)
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            config=BotoConfig(retries={"max_attempts": 3, "mode": "standard"}),
        )
        self.transfer = TransferConfig(
            multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES, max_concurrency=4
        )
        if check:
            self.check()

    def check(self) -> None:
        """Fail at start-up, with the reason, when the bucket cannot be reached."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (ClientError, BotoCoreError) as err:
            raise InvalidArgumentError(
                f"store: cannot reach bucket {self.bucket!r} of {self.url!r}: {err}"
            ) from None

    # ---- names -----------------------------------------------------------------------

    def state_path(self, tenant_id: str, model_id: str, name: str) -> str:
        key = "/".join(p for p in (self.prefix, tenant_id, model_id, name) if p)
        return f"s3://{self.bucket}/{key}"

    def state_dir(self, tenant_id: str, model_id: str, name: str) -> Path:
        """``state_path`` as a ``Path`` (which reads ``s3:/...``; every consumer of a
        storage path mends it with ``storage_path_str``). Prefer ``state_path``."""
        return Path(self.state_path(tenant_id, model_id, name))

    def _key(self, storage_path: str | Path) -> str:
        bucket, key = parse_s3_url(storage_path_str(storage_path), "storage_path")
        if bucket != self.bucket:
            raise NotFoundError(f"path: {storage_path!r} is not in this store's bucket")
        return key

    # ---- staging ---------------------------------------------------------------------

    def staging_dir(self, storage_path: str) -> Path:
        """A fresh local directory (its parent exists; the engine creates it)."""
        parent = self.local_root / "out" / uuid.uuid4().hex
        parent.mkdir(parents=True)
        return parent / Path(self._key(storage_path)).name

    def commit(self, local_dir: Path, storage_path: str) -> int:
        """Upload the directory; the manifest goes last, so a reader that finds it
        finds every file it names. Objects of an older save of the same name that the
        new one lacks are deleted. Returns the bytes uploaded. The local copy is
        released once uploaded; after a failure it is left to the caller (to try
        again, or release)."""
        key = self._key(storage_path)
        files = sorted(
            (p for p in Path(local_dir).iterdir() if p.is_file()), key=lambda p: p.name == MANIFEST
        )
        try:
            stale = set(self._list(key)) - {f"{key}/{p.name}" for p in files}
            size = 0
            for path in files:
                self.client.upload_file(
                    str(path), self.bucket, f"{key}/{path.name}", Config=self.transfer
                )
                size += path.stat().st_size
            self._delete_keys(sorted(stale))
        except (ClientError, BotoCoreError) as err:
            raise UnavailableError(f"store: upload of {storage_path} failed: {err}") from None
        self.release(local_dir, storage_path)
        return size

    def fetch(self, storage_path: str) -> Path:
        key = self._key(storage_path)
        local = self.local_root / "in" / uuid.uuid4().hex / Path(key).name
        local.mkdir(parents=True)
        try:
            names = self._list(key)
            if not names:  # (a checkpoint without its manifest fails where it is read)
                raise NotFoundError(f"path: no checkpoint at {storage_path}")
            for name in names:
                self.client.download_file(
                    self.bucket, name, str(local / name.rsplit("/", 1)[1]), Config=self.transfer
                )
        except (ClientError, BotoCoreError) as err:
            self.release(local, storage_path)
            raise UnavailableError(f"store: download of {storage_path} failed: {err}") from None
        except Exception:
            self.release(local, storage_path)
            raise
        return local

    def release(self, local_dir: Path, storage_path: str) -> None:
        local = Path(local_dir)
        if local.parent.parent.parent == self.local_root:  # <root>/<in|out>/<uuid>/<name>
            shutil.rmtree(local.parent, ignore_errors=True)

    # ---- reads and deletes -------------------------------------------------------------

    def read_manifest(self, storage_path: str) -> dict[str, Any]:
        from treadle.common.manifest import read_manifest

        key = self._key(storage_path)
        with tempfile.TemporaryDirectory(dir=self.local_root) as tmp:
            try:
                self.client.download_file(self.bucket, f"{key}/{MANIFEST}", f"{tmp}/{MANIFEST}")
            except ClientError as err:
                if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                    raise NotFoundError(f"path: no checkpoint at {storage_path}") from None
                raise UnavailableError(f"store: {err}") from None
            return read_manifest(tmp)

    def delete(self, storage_path: str) -> None:
        key = self._key(storage_path)
        self._delete_keys(self._list(key))

    def _list(self, key: str) -> list[str]:
        names: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=f"{key}/", Delimiter="/"):
            names.extend(obj["Key"] for obj in page.get("Contents", ()))
        return names

    def _delete_keys(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            if batch:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch})
