"""LoRA on a random-weight model learns with the default modules (tinker's flags).

On the ``tiny`` preset (random weights, random output head) an adapter on the
attention and MLP projections only stalls near 3.8 nats/token on the demo's
addition task: behind the final RMSNorm the frozen head bounds the logits.
The default, like the tinker SDK's, also adapts the head (``train_unembed``),
and the same run falls to about 1.2 (``scripts/lora_sweep.py --preset tiny
--steps 60 --batch 16`` measured 1.21 vs 3.87 at rank 8, lr 1e-2).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import treadle
from tests.conftest import make_server
from treadle.errors import FailedPreconditionError, InvalidArgumentError
from treadle.server.embedded import EmbeddedServer

STEPS, BATCH, RANK, LR = 60, 16, 8, 1e-2
#: measured 1.21 (defaults) and 3.87 (attn + mlp only) in-process; margin both ways
LEARNS_BELOW = 2.5


@pytest.fixture(scope="module")
def client(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[treadle.ServiceClient]:
    srv: EmbeddedServer = make_server(tmp_path_factory.mktemp("lora"), {"tiny": tiny_model_dir})
    with treadle.ServiceClient(srv.address, api_key=srv.api_key) as c:
        yield c
    srv.stop()


def _batch(tok: treadle.Tokenizer, rng: random.Random) -> list[treadle.Datum]:
    """Single-digit addition, cross-entropy on the answer and EOS, token mean."""
    pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(BATCH)]
    n_answer = sum(len(str(a + b)) + 1 for a, b in pairs)
    out = []
    for a, b in pairs:
        prompt = [tok.bos_token_id, *tok.encode(f"{a}+{b}=")]
        full = prompt + [*tok.encode(str(a + b)), tok.eos_token_id]
        weights = [0.0] * (len(prompt) - 1) + [1 / n_answer] * (len(full) - len(prompt))
        out.append(
            treadle.Datum(
                model_input=treadle.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
            )
        )
    return out


def _supervised(client: treadle.ServiceClient, tc: treadle.TrainingClient) -> list[float]:
    tok = client.get_tokenizer("tiny")
    rng = random.Random(0)
    futures = []
    for _ in range(STEPS):
        futures.append(tc.forward_backward(_batch(tok, rng)))
        tc.optim_step(treadle.AdamParams(learning_rate=LR))
    return [f.result().metrics["loss:sum"] for f in futures]


def test_default_lora_learns_on_the_tiny_model(client: treadle.ServiceClient) -> None:
    losses = _supervised(client, client.create_lora_training_client("tiny", rank=RANK))
    assert losses[0] > 4.0  # ln(104) ~ 4.6: the random model is near uniform
    assert float(np.mean(losses[-10:])) < LEARNS_BELOW


def test_without_the_head_it_stalls(client: treadle.ServiceClient) -> None:
    """What the defaults were before train_unembed: the stall users met."""
    tc = client.create_lora_training_client("tiny", rank=RANK, train_unembed=False)
    assert float(np.mean(_supervised(client, tc)[-10:])) > 3.0


def test_no_module_at_all_is_invalid(client: treadle.ServiceClient) -> None:
    with pytest.raises(InvalidArgumentError, match="train_mlp, train_attn, train_unembed"):
        client.create_lora_training_client(
            "tiny", rank=4, train_attn=False, train_mlp=False, train_unembed=False
        )
    with pytest.raises(InvalidArgumentError, match="train_attn, train_mlp, train_unembed"):
        client._create(  # past the SDK's own check: the server refuses it too
            base_model="tiny", lora_rank=4, train_attn=False, train_mlp=False, train_unembed=False
        )


def test_the_modules_travel_with_the_state(client: treadle.ServiceClient, tmp_path: Path) -> None:
    mlp_only = client.create_lora_training_client(
        "tiny", rank=2, train_attn=False, train_unembed=False
    )
    path = mlp_only.save_state("mlp").result().path
    again = client.create_training_client_from_state(path)
    config = json.loads((again.export_weights(tmp_path / "a") / "adapter_config.json").read_text())
    assert config["target_modules"] == ["gate_proj", "up_proj", "down_proj"]
    # A model adapting other modules cannot take that state in place.
    default = client.create_lora_training_client("tiny", rank=2)
    with pytest.raises(FailedPreconditionError, match="path"):
        default.load_state(path).result()
