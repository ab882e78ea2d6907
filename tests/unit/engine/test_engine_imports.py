"""The engine imports on a bare GPU image: torch, transformers, safetensors,
tokenizers (and numpy, which they bring) and nothing of the server or the
client's transport.

A fresh interpreter refuses every other third-party package a treadle install
brings (a meta path finder raises ImportError for them), then imports the
engine modules; an import of a server package anywhere on the way fails it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

#: packages a bare GPU image lacks: the server's, the client transport's, the worker's queue
BLOCKED = (
    "grpc",
    "google",
    "sqlalchemy",
    "alembic",
    "psycopg",
    "celery",
    "kombu",
    "redis",
    "boto3",
    "botocore",
    "msgpack",
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "zstandard",
    "vllm",
    "treadle.server",
    "treadle.v1",
)

ENGINE_MODULES = (
    "treadle.workers.model",
    "treadle.workers.trainer.trainer",
    "treadle.workers.sampler.torch_sampler",
    "treadle.workers.trainer.losses",
    "treadle.workers.device.device",
    "treadle.workers.engine.loop",
    "treadle.workers.trainer.checkpoint",
)

SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.abc, sys

    BLOCKED = {blocked!r}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ImportError(f"{{name}} is not on a bare GPU image")
            return None

    sys.meta_path.insert(0, Block())
    for name in {modules!r}:
        importlib.import_module(name)
    print("ok")
    """
)


def test_the_engine_imports_without_server_packages() -> None:
    script = SCRIPT.format(blocked=BLOCKED, modules=ENGINE_MODULES)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_the_block_catches_a_server_import() -> None:
    """The check can fail: the server's config imports a blocked package."""
    script = SCRIPT.format(blocked=BLOCKED, modules=("treadle.server.config",))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "not on a bare GPU image" in done.stderr
