"""``--device``: what it resolves to, the dtype each device defaults to and
refuses, and the clear exit of ``treadle serve``/``treadle worker`` when the
device asked for does not exist here (CUDA is faked away or in where needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from treadle.errors import InvalidArgumentError
from treadle.server.cli import main
from treadle.server.config import ServerConfig
from treadle.workers.device import device


@pytest.fixture()
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture()
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host with one GPU, as far as ``workers.device.device`` asks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None: "Old GPU")


def test_auto_is_the_cpu_without_cuda_and_float32_there(no_cuda: None) -> None:
    assert device.canonical("auto") == "cpu"
    assert device.default_dtype(device.resolve("auto")) == "float32"
    device.check_dtype(device.cpu(), "bfloat16")  # the CPU runs every dtype


def test_auto_is_the_gpu_with_cuda_and_bfloat16_there(one_gpu: None) -> None:
    assert device.canonical("auto") == "cuda:0"
    assert device.canonical("cuda") == "cuda:0"
    assert device.default_dtype(device.resolve("cuda:0")) == "bfloat16"


def test_cuda_without_cuda_names_the_flag_and_the_way_out(no_cuda: None) -> None:
    with pytest.raises(InvalidArgumentError, match=r"device: 'cuda'.*no CUDA.*--device cpu"):
        device.resolve("cuda")


def test_a_gpu_that_does_not_exist(one_gpu: None) -> None:
    with pytest.raises(InvalidArgumentError, match=r"'cuda:7' does not exist.*1 CUDA device"):
        device.resolve("cuda:7")
    for bad in ("gpu", "cuda:x", "cuda:"):
        with pytest.raises(InvalidArgumentError, match="device: "):
            device.resolve(bad)


def test_a_dtype_the_gpu_cannot_run(one_gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    with pytest.raises(InvalidArgumentError, match=r"dtype: bfloat16 is not supported by Old GPU"):
        device.check_dtype(device.resolve("cuda"), "bfloat16")
    device.check_dtype(device.resolve("cuda"), "float32")


def test_the_config_refuses_a_missing_device(no_cuda: None, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="device: 'cuda:1'"):
        ServerConfig(data_dir=tmp_path, device="cuda:1")
    assert ServerConfig(data_dir=tmp_path, device="cpu").device == "cpu"


def test_a_sampler_process_stays_on_the_cpu(one_gpu: None, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="sampler: torch-process .*torch-thread"):
        ServerConfig(data_dir=tmp_path, device="cuda:0", sampler="torch-process")


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_the_commands_exit_2_with_the_message(
    no_cuda: None, command: str, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [command, "--device", "cuda", "--model", f"tiny={tiny_model_dir}"]
    if command == "worker":
        args += ["--broker", "redis://127.0.0.1:6379/0", "--database-url", "sqlite:///x.db"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "device: 'cuda' asked for, but torch sees no CUDA device" in err


def test_the_flags_resolve_auto(no_cuda: None, tmp_path: Path) -> None:
    import argparse

    from treadle.workers.engine.flags import add_engine_flags, engine_config, engine_settings

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    settings = engine_settings(parser.parse_args([]))
    assert (settings["device"], settings["default_dtype"]) == ("cpu", "float32")
    settings = engine_settings(parser.parse_args(["--device", "cpu", "--dtype", "bfloat16"]))
    made = engine_config(ServerConfig(data_dir=tmp_path, **settings), {}, None)
    assert (made.device, made.default_dtype) == ("cpu", "bfloat16")


def test_host_copies_are_equal_contiguous_host_tensors() -> None:
    t = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    out = device.host_copies({"a": t, "b": torch.ones(2)})
    assert out["a"].is_contiguous() and out["a"].device.type == "cpu"
    assert torch.equal(out["a"], t) and torch.equal(out["b"], torch.ones(2))


def test_out_of_memory_in_a_call_is_resource_exhausted(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An injected ``torch.OutOfMemoryError`` (what CUDA raises) in a forward_backward
    and in an optim_step: RESOURCE_EXHAUSTED, the model unchanged (gradients, moments,
    weights, version), and the next calls apply."""
    import numpy as np

    from treadle.common.engine.domain import (
        AdamConfig,
        DatumData,
        ForwardBackwardOp,
        ModelSpec,
        OptimStepOp,
    )
    from treadle.errors import ResourceExhaustedError
    from treadle.workers.engine.loop import Engine, EngineConfig
    from treadle.workers.trainer import optimizer, trainer

    def oom(*_args: object, **_kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    engine = Engine(EngineConfig(base_models={"tiny": tiny_model_dir}, threads=1)).start()
    try:
        engine.create_model(ModelSpec("m", "t", "tiny", 4, 8.0, 0, "float32")).result(60)
        toks = np.arange(3, 20)
        datum = DatumData(
            toks[:-1], {"target_tokens": toks[1:], "weights": np.ones(16, np.float32)}
        )
        fb = ForwardBackwardOp((datum,), "cross_entropy", {})
        engine.submit("m", 1, fb, "a").result(60)
        model = engine.models["m"]
        grads = {n: t.grad.clone() for n, t in model.trainable.items()}
        weights = {n: t.detach().clone() for n, t in model.trainable.items()}

        with monkeypatch.context() as patch:
            patch.setattr(trainer, "forward_hidden", oom)
            err = engine.submit("m", 2, fb, "b").exception(60)
        assert isinstance(err, ResourceExhaustedError)
        assert "out of device memory" in str(err) and "9.00 GiB" in str(err)
        with monkeypatch.context() as patch:
            patch.setattr(optimizer, "_scratch", oom)
            err = engine.submit("m", 3, OptimStepOp(AdamConfig(learning_rate=0.1)), "c").exception(
                60
            )
        assert isinstance(err, ResourceExhaustedError)
        assert model.version == 0 and model.optimizer.step_count == 0
        for n, t in model.trainable.items():
            assert torch.equal(t.grad, grads[n]) and torch.equal(t.detach(), weights[n])
            assert not model.optimizer.exp_avg[n].any()

        result = engine.submit("m", 4, OptimStepOp(AdamConfig(learning_rate=0.1)), "d").result(60)
        assert result.step == 1 and model.version == 1
    finally:
        engine.stop()
