"""tinker-cookbook 0.5.8's own ``ProblemEnv`` / ``ProblemGroupBuilder`` through
``treadle.rl.cookbook`` in treadle's episode loops (issue 41).

The cookbook lives in an environment of its own (``tests/cookbook_env.py``: it
pins ``transformers<=5.5.4``). The treadle SDK there is this source tree's
``client_sdk`` (as the ``treadle`` package, by a link on ``PYTHONPATH``) with
grpcio and protobuf at this environment's versions installed beside it into a
cached folder of their own, so the shared cookbook venv is left as built.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from pathlib import Path

import google.protobuf
import grpc
import pytest

import treadle
from tests.cookbook_env import cookbook_python, venv_dir
from treadle.server.embedded import EmbeddedServer

pytestmark = [pytest.mark.slow]

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
PINS = (f"grpcio=={grpc.__version__}", f"protobuf=={google.protobuf.__version__}")


def sdk_path(python: Path, tmp: Path) -> str:
    """A PYTHONPATH giving the cookbook venv this tree's SDK: grpcio and protobuf
    installed (once, cached, under a lock) into a folder beside the venv, and a
    ``treadle`` link to ``client_sdk``."""
    overlay = venv_dir().parent / ("sdk-overlay-" + "-".join(PINS).replace("==", "-"))
    with open(str(overlay) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (overlay / "grpc").is_dir():
            done = subprocess.run(
                [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                 "--target", str(overlay), *PINS],
                capture_output=True, text=True, timeout=900,
            )  # fmt: skip
            if done.returncode != 0:
                pytest.skip(f"grpcio/protobuf for the cookbook venv: {done.stderr[-1000:]}")
    links = tmp / "sdk"
    links.mkdir()
    (links / "treadle").symlink_to(ROOT / "client_sdk", target_is_directory=True)
    return os.pathsep.join([str(links), str(overlay)])


def test_a_cookbook_env_group_runs_through_the_episode_loops(
    server: EmbeddedServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    python = cookbook_python()
    env = {**os.environ, "PYTHONPATH": sdk_path(python, tmp_path), "HF_HUB_OFFLINE": "1"}
    env.pop("TREADLE_API_KEY", None)
    done = subprocess.run(
        [str(python), str(HERE / "run_cookbook_env.py"), server.address, server.api_key,
         "tiny", str(tiny_model_dir)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # two training steps, one group of the builder's 4 episodes each, none failed
    assert [s[:3] for s in out["steps"]] == [[1, 4, 0], [2, 4, 0]]
    for episode in out["episodes"]:
        assert episode["error"] is None and episode["done"] and episode["turns"] == 1
        # the prompt is the cookbook renderer's, token for token
        assert episode["observation"] == out["prompt"]
        # the cookbook's reward: format_coef * (format - 1) + correct
        assert episode["reward"] in (-0.1, 0.0, 0.9, 1.0)
        assert set(episode["metrics"]) == {"format", "correct"}
    assert out["stop"]  # the renderer's stop sequences, used as each turn's stop
    assert treadle.__version__  # the same SDK source on both sides
