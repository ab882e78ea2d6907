"""tinker-cookbook 0.5.8, unmodified and from its installed package, against
``treadle serve``'s HTTP API, offline: its minimal SL and RL loops
(``recipes/sl_loop.py``, ``recipes/rl_loop.py``) and the function that reads a
run's renderer back from a checkpoint (issue 40).

The cookbook runs on the client side in an environment of its own
(``tests/cookbook_env.py``: it pins ``transformers<=5.5.4``, which the server's
cannot take), as on a laptop. The base model is served under a hub-style name,
``meta-llama/Llama-3.2-1B`` (the cookbook picks its renderer by that name:
``role_colon``), from a tiny model in a directory at that relative path, so the
cookbook's ``get_tokenizer(model_name)`` reads it there, offline. The datasets
the recipes load by name (No Robots, GSM8K) are replaced by a few local rows
(``run_recipe.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cookbook_env import cookbook_python
from tests.integration.serve_process import ServeProcess, free_port_pair
from treadle.workers.model.tiny import build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

HERE = Path(__file__).parent
MODEL = "meta-llama/Llama-3.2-1B"
NO_ROBOTS = "HuggingFaceH4/no_robots"
GSM8K = "openai/gsm8k"


@dataclass
class Cookbook:
    python: Path
    cwd: Path  # holds the model directory at MODEL's relative path
    url: str
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(self.python), *args],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"{args}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        return done

    def recipe(self, module: str, log_path: Path, **config: object) -> list[dict[str, float]]:
        """Run the recipe; the metrics it logged, one row per step."""
        args = [
            f"{k}={v}" for k, v in {"base_url": self.url, "model_name": MODEL, **config}.items()
        ]
        self.run(str(HERE / "run_recipe.py"), module, f"log_path={log_path}", *args)
        lines = (log_path / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]


def _datasets(tmp: Path) -> dict[str, str]:
    """A few rows in each dataset's own shape (its train split)."""
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"What is {a} plus {b}?"},
                {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
            ]
        }
        for a, b in [(i % 7 + 1, i % 5 + 2) for i in range(32)]
    ]
    problems = [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many now?",
            "answer": f"#### {a + b}",
        }
        for a, b in [(i + 2, i + 3) for i in range(8)]
    ]
    out = {}
    for name, rows in ((NO_ROBOTS, chats), (GSM8K, problems)):
        path = tmp / (name.replace("/", "_") + ".json")
        path.write_text(json.dumps(rows))
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def cookbook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cookbook]:
    python = cookbook_python()
    tmp = tmp_path_factory.mktemp("cookbook")
    model_dir = build_tiny_model(tmp / MODEL, preset="tiny", seed=0)
    # served under the name asked for (MODEL), from the directory at that relative path
    server = ServeProcess(tmp, f"{MODEL}={model_dir}", "--port", str(free_port_pair()))
    try:
        url, key = server.wait_serving()
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("TREADLE_", "PYTHON", "VIRTUAL_ENV"))
        }
        env.update(
            TINKER_API_KEY="tml-" + key,
            TINKER_TELEMETRY="0",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            WANDB_MODE="disabled",
            OMP_NUM_THREADS="1",
            COOKBOOK_LOCAL_DATASETS=json.dumps(_datasets(tmp)),
        )
        yield Cookbook(python, tmp, url, env)
    finally:
        server.stop()
        print(server.output()[-2000:], file=sys.stderr)


def test_sl_loop_trains_and_checkpoints(cookbook: Cookbook) -> None:
    log = cookbook.cwd / "sl"
    rows = cookbook.recipe(
        "tinker_cookbook.recipes.sl_loop",
        log,
        batch_size=4,
        max_steps=6,
        learning_rate=2e-2,
        lora_rank=8,
        save_every=3,
        max_length=128,
    )
    nll = [r["train_mean_nll"] for r in rows]
    print("sl_loop train_mean_nll per step:", [round(x, 4) for x in nll])
    assert len(nll) == 6
    assert nll[-1] < 0.8 * nll[0]  # the same chat shape every step: it learns it
    checkpoints = [
        json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()
    ]
    assert [c["name"] for c in checkpoints] == ["000003", "final"]
    assert checkpoints[-1]["state_path"].startswith("tinker://")
    assert checkpoints[-1]["sampler_path"].startswith("tinker://")


def test_rl_loop_samples_scores_and_steps(cookbook: Cookbook) -> None:
    log = cookbook.cwd / "rl"
    rows = cookbook.recipe(
        "tinker_cookbook.recipes.rl_loop",
        log,
        batch_size=2,
        group_size=4,
        max_tokens=8,
        max_steps=2,
        lora_rank=4,
        save_every=0,
    )
    print("rl_loop rows:", rows)
    assert [r["progress/batch"] for r in rows] == [0, 1]
    assert all(0.0 <= r["reward/total"] <= 1.0 for r in rows)
    checkpoints = [
        json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()
    ]
    assert checkpoints[-1]["name"] == "final"
    assert checkpoints[-1]["sampler_path"].startswith("tinker://")


def test_renderer_name_comes_back_from_a_checkpoint(cookbook: Cookbook) -> None:
    """The function that failed before issue 40: the run's user_metadata names the
    renderer, so a checkpoint of it resolves to that renderer, not the model's default."""
    done = cookbook.run(str(HERE / "renderer_from_checkpoint.py"), cookbook.url, MODEL)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["default"] == "role_colon"
    assert got["run_metadata"]["renderer_name"] == "llama3"
    assert set(got["resolved"].values()) == {"llama3"}, got
