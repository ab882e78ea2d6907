"""A published weight version as files, for sampler workers apart from the trainer.

The trainer writes one version once (``ShipVersionCall``: one upload to the
store); each sampler worker of the pool reads it (``LoadVersionCall``: many
readers). One safetensors file, ``weights.safetensors``, whose metadata says
what it holds:

- ``kind=lora``: the adapter's tensors by their PEFT names (a few MB), read
  onto the sampler worker's own copy of the base;
- ``kind=full``: every weight of a full fine-tune by its HF name (a whole model).

A version is named by ``(model_id, version)``: the file carries both, and a
reader checks them, so a version is never served under another's name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from treadle.errors import FailedPreconditionError
from treadle.workers.device import device
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model.llama import LlamaParams
from treadle.workers.model.lora import LoraAdapter

FILE = "weights.safetensors"


def write_version(snapshot: WeightSnapshot, directory: Path) -> int:
    """Write ``snapshot`` under ``directory``; the bytes written."""
    assert snapshot.model_id is not None
    directory.mkdir(parents=True, exist_ok=True)
    meta = {
        "model_id": snapshot.model_id,
        "version": str(snapshot.version),
        "dtype": str(snapshot.dtype).removeprefix("torch."),
    }
    if snapshot.adapter is not None:
        tensors = dict(snapshot.adapter.named_tensors())
        meta |= {"kind": "lora", "alpha": repr(snapshot.adapter.alpha)}
    else:
        tensors = snapshot.params.state_dict()
        meta |= {"kind": "full"}
    path = directory / FILE
    save_file(device.host_copies(tensors), str(path), metadata=meta)
    return path.stat().st_size


def read_version(
    directory: Path, base_at: Callable[[str], BaseModel], model_id: str, version: int
) -> WeightSnapshot:
    """The version written by ``write_version``; ``base_at(dtype)``: the base model at
    the dtype the version was trained at (a LoRA adapter sits on its weights)."""
    path = Path(directory) / FILE
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
        base = base_at(meta.get("dtype", "float32"))
        tensors = {name: f.get_tensor(name).to(device=base.device) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    if meta.get("model_id") != model_id or meta.get("version") != str(version):
        raise FailedPreconditionError(
            f"shipped weights at {directory} are treadle://{meta.get('model_id')}/v/"
            f"{meta.get('version')}, not treadle://{model_id}/v/{version}"
        )
    if meta.get("kind") == "lora":
        adapter = LoraAdapter.from_named_tensors(base.cfg, tensors, alpha=float(meta["alpha"]))
        return WeightSnapshot(model_id, version, base.params, adapter)
    params = LlamaParams.from_state_dict(base.cfg, tensors)
    return WeightSnapshot(model_id, version, params, None)
