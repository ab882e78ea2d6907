"""The weights of a ``ForwardLogprobs`` reference other than the base model.

After a supervised warm-up the base model is the random start, so a KL penalty
to it pulls the policy back through the warm-up; the reference a loop wants is
the warm-up's end. A tenant names it by a state it saved
(``treadle://<model_id>/state/<name>``) or a published version still kept
(``treadle://<model_id>/v/<v>``); the server has checked the tenant owns it and
resolved the state to its directory.

The reference is a separate ``WeightSnapshot`` read under ``no_grad``: the
training model's weights, accumulated gradients and optimizer state are never
touched. A LoRA reference is an adapter on the shared base (small); a full
fine-tune's reference is a whole copy of the model's weights. A state read
from disk is kept in the model's ``ReferenceCache`` (two entries), so a loop
that asks every step reads the checkpoint once; a kept version is already in
memory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from treadle.common.engine.domain import ReferenceWeights
from treadle.common.manifest import read_manifest
from treadle.errors import InvalidArgumentError, NotFoundError
from treadle.workers.engine.versions import VersionStore, WeightSnapshot
from treadle.workers.model.llama import LlamaParams
from treadle.workers.model.lora import LoraAdapter
from treadle.workers.trainer.trainer import TrainingModel

FIELD = "reference_path"


def resolve(model: TrainingModel, ref: ReferenceWeights, versions: VersionStore) -> WeightSnapshot:
    """The reference's weights, from the model's cache, its checkpoint, or the kept versions."""
    if not ref.directory:
        try:
            return versions.get(ref.model_id, ref.version)
        except NotFoundError:
            raise NotFoundError(
                f"{FIELD}: {ref.uri!r} is not kept any more (versions kept: "
                f"{versions.versions(ref.model_id)}); save_state the weights you want "
                "as a reference and name that state"
            ) from None
    try:
        manifest = read_manifest(ref.directory)
    except NotFoundError:
        raise NotFoundError(f"{FIELD}: checkpoint {ref.uri!r} not found") from None
    except InvalidArgumentError:
        raise InvalidArgumentError(
            f"{FIELD}: {ref.uri!r} is not a checkpoint this server can read"
        ) from None
    # The uri, not the directory: a store other than local hands the engine a fresh
    # download each call (``workers.engine.staging``); the state's write time and seq_id
    # tell a state saved again under the same name.
    key = (ref.uri, manifest.get("created_at"), manifest.get("seq_id"))
    return model.references.get(key, lambda: _load(model, ref, manifest))


@torch.no_grad()
def _load(model: TrainingModel, ref: ReferenceWeights, manifest: dict) -> WeightSnapshot:
    if manifest["base_model"] != model.spec.base_model:
        raise InvalidArgumentError(
            f"{FIELD}: {ref.uri!r} is a state of base model {manifest['base_model']!r}; "
            f"this model's base is {model.spec.base_model!r}"
        )
    path = Path(ref.directory) / "weights.safetensors"
    if not path.is_file():
        raise NotFoundError(f"{FIELD}: {ref.uri!r} has no weights")
    dtype = model.base.dtype
    device = model.base.device
    tensors = {n: t.to(dtype=dtype, device=device) for n, t in load_file(str(path)).items()}
    step = int(manifest["step"])
    if int(manifest["lora_rank"]) > 0:
        alpha = float(manifest["lora_alpha"])
        adapter = LoraAdapter.from_named_tensors(model.cfg, tensors, alpha=alpha)
        # a LoRA model's base as it reads it (on a group, perhaps its shards: the
        # forward then runs on them); a full fine-tune's base, whole
        base = model.params if model.adapter is not None else model.base.params
        return WeightSnapshot(None, step, base, adapter)
    return WeightSnapshot(None, step, LlamaParams.from_state_dict(model.cfg, tensors), None)
