"""Exported weights load elsewhere: a PEFT adapter directory with PEFT's names and
config, and a merged HF checkpoint that transformers loads and that computes the
trained model's logprobs."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import treadle
from tests.conftest import make_server
from treadle.errors import InvalidArgumentError, NotFoundError
from treadle.server.embedded import EmbeddedServer

TEXTS = ("12+3=15", "4+4=8", "20-7=13", "6*7=42")
PEFT_KEY = "base_model.model.model.layers.{n}.{module}.{target}.lora_{which}.weight"
TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[EmbeddedServer]:
    server = make_server(tmp_path_factory.mktemp("export"), {"tiny": tiny_model_dir})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv: EmbeddedServer) -> Iterator[treadle.ServiceClient]:
    with treadle.ServiceClient(srv.address, api_key=getattr(srv, "api_key", None)) as c:
        yield c


def _datums(client: treadle.ServiceClient, base: str = "tiny") -> list[treadle.Datum]:
    tok = client.get_tokenizer(base)
    out = []
    for text in TEXTS:
        ids = tok.encode(text)
        out.append(
            treadle.Datum(
                model_input=treadle.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": np.ones(len(ids) - 1)},
            )
        )
    return out


def _train(tc: treadle.TrainingClient, data: list[treadle.Datum], steps: int, lr: float) -> None:
    """Sends the calls without waiting: the export must wait for them itself."""
    for _ in range(steps):
        tc.forward_backward(data)
        tc.optim_step(treadle.AdamParams(learning_rate=lr))


def _hf_logprobs(model_dir: Path, data: list[treadle.Datum]) -> list[np.ndarray]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for d in data:
            tokens = torch.tensor([d.model_input.to_ints()])
            logits = model(input_ids=tokens).logits[0].to(torch.float64)
            targets = torch.as_tensor(np.asarray(d.loss_fn_inputs["target_tokens"]))
            lp = torch.log_softmax(logits, -1).gather(-1, targets.long()[:, None])[:, 0]
            out.append(lp.numpy())
    return out


def test_peft_export_equals_the_adapter(
    client: treadle.ServiceClient, srv: EmbeddedServer, tmp_path: Path
) -> None:
    data = _datums(client)
    tc = client.create_lora_training_client("tiny", rank=4, seed=3, alpha=8.0)
    _train(tc, data, steps=3, lr=1e-2)
    out = tc.export_weights(tmp_path / "adapter")
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["base_model_name_or_path"] == "tiny"
    assert sorted(config["target_modules"]) == sorted([*TARGETS, "lm_head"])  # tinker's default

    tensors = load_file(str(out / "adapter_model.safetensors"))
    hf_config = json.loads((srv.config.models["tiny"] / "config.json").read_text())
    h, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    head_dim, inter = h // heads, hf_config["intermediate_size"]
    shapes = {  # (out, in) of each projection, as transformers builds it
        "q_proj": (heads * head_dim, h),
        "k_proj": (kv_heads * head_dim, h),
        "v_proj": (kv_heads * head_dim, h),
        "o_proj": (h, heads * head_dim),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }
    expected = {}
    for n in range(layers):
        for target, module in TARGETS.items():
            out_f, in_f = shapes[target]
            expected[PEFT_KEY.format(n=n, module=module, target=target, which="A")] = (4, in_f)
            expected[PEFT_KEY.format(n=n, module=module, target=target, which="B")] = (out_f, 4)
    expected["base_model.model.lm_head.lora_A.weight"] = (4, h)  # train_unembed
    expected["base_model.model.lm_head.lora_B.weight"] = (hf_config["vocab_size"], 4)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected

    # The same tensors the engine trains (and its own checkpoint holds).
    saved = tc.save_state("after3").result()
    assert saved.step == 3
    engine_model = srv.ctx.dispatcher.engine.models[tc.model_id]  # type: ignore[attr-defined]
    live = {k: v.detach() for k, v in engine_model.adapter.named_tensors()}
    for name, tensor in tensors.items():
        torch.testing.assert_close(tensor, live[name], rtol=0, atol=0)
    assert any(t.abs().sum() > 0 for k, t in tensors.items() if "lora_B" in k)  # trained


def test_merged_export_loads_in_transformers_and_matches(
    client: treadle.ServiceClient, tmp_path: Path
) -> None:
    data = _datums(client)
    tc = client.create_lora_training_client("tiny", rank=4, seed=1)
    _train(tc, data, steps=3, lr=2e-2)
    out = tc.export_weights(tmp_path / "merged", merged=True)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names

    trained = [
        np.asarray(o["logprobs"]) for o in tc.forward_logprobs(data).result().loss_fn_outputs
    ]
    base = [
        np.asarray(o["logprobs"])
        for o in tc.forward_logprobs(data, reference=True).result().loss_fn_outputs
    ]
    exported = _hf_logprobs(out, data)
    for got, want, ref in zip(exported, trained, base, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        assert np.abs(want - ref).max() > 1e-3  # the adapter changed something

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok.encode("12+3=15", add_special_tokens=False)) == "12+3=15"


def test_peft_export_follows_the_modules_trained(
    client: treadle.ServiceClient, tmp_path: Path
) -> None:
    tc = client.create_lora_training_client(
        "tiny", rank=2, train_attn=False, train_mlp=True, train_unembed=False
    )
    out = tc.export_weights(tmp_path / "mlp-only")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["gate_proj", "up_proj", "down_proj"]
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert {k.split(".")[-3] for k in tensors} == {"gate_proj", "up_proj", "down_proj"}


def test_merged_export_of_a_tied_model_with_an_adapted_head(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The 110m preset ties its embeddings: the adapted head is written as its own
    ``lm_head.weight`` and the config untied, and transformers computes the same."""
    from treadle.workers.model.tiny import build_tiny_model

    tied_dir = build_tiny_model(
        tmp_path_factory.mktemp("tied"), overrides={"tie_word_embeddings": True}
    )
    server = make_server(tmp_path_factory.mktemp("tied-srv"), {"tied": tied_dir})
    try:
        with treadle.ServiceClient(server.address, api_key=server.api_key) as c:
            data = _datums(c, "tied")
            tc = c.create_lora_training_client("tied", rank=4, seed=2)
            _train(tc, data, steps=3, lr=2e-2)
            out = tc.export_weights(tmp_path / "merged", merged=True)
            trained = [
                np.asarray(o["logprobs"])
                for o in tc.forward_logprobs(data).result().loss_fn_outputs
            ]
    finally:
        server.stop()
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    for got, want in zip(_hf_logprobs(out, data), trained, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_full_finetune_exports_merged_only(client: treadle.ServiceClient, tmp_path: Path) -> None:
    data = _datums(client)[:2]
    tc = client.create_training_client("tiny", seed=2)
    _train(tc, data, steps=2, lr=1e-3)
    with pytest.raises(InvalidArgumentError, match="merged"):
        tc.export_weights(tmp_path / "peft")
    out = tc.export_weights(tmp_path / "full", merged=True)
    trained = [
        np.asarray(o["logprobs"]) for o in tc.forward_logprobs(data).result().loss_fn_outputs
    ]
    for got, want in zip(_hf_logprobs(out, data), trained, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_export_of_unknown_model_is_not_found(
    client: treadle.ServiceClient, tmp_path: Path
) -> None:
    tc = client.create_lora_training_client("tiny", rank=2)
    ghost = treadle.TrainingClient(client, dataclasses.replace(tc._info, model_id="m-nope"))
    with pytest.raises(NotFoundError):
        ghost.export_weights(tmp_path / "ghost")
