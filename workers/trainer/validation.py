"""What a training call sends, checked before anything runs: its datums (token
ids in the vocabulary, lengths within the context, inputs shaped like the
tokens and finite), its temperature and its Adam settings. Each refusal is an
INVALID_ARGUMENT naming the field."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treadle.common.engine.domain import AdamConfig, DatumData
from treadle.errors import InvalidArgumentError


def validate_data(
    data: Sequence[DatumData], vocab_size: int, max_len: int, *, need_targets: bool = True
) -> None:
    if not data:
        raise InvalidArgumentError("data: empty batch")
    for i, datum in enumerate(data):
        tokens = datum.tokens
        if tokens.ndim != 1 or tokens.size == 0:
            raise InvalidArgumentError(
                f"data[{i}].model_input: must be a non-empty 1-D token sequence"
            )
        if tokens.size > max_len:
            raise InvalidArgumentError(
                f"data[{i}].model_input: {tokens.size} tokens exceed the context of {max_len} "
                "tokens (the same limit the sampler applies; GetServerInfo's max_context): "
                "shorten or split the datum"
            )
        check_ids(tokens, vocab_size, f"data[{i}].model_input")
        for key, arr in datum.inputs.items():
            if arr.shape != tokens.shape:
                raise InvalidArgumentError(
                    f"data[{i}].loss_fn_inputs.{key}: length {arr.shape[0] if arr.ndim else 0} "
                    f"differs from model_input length {tokens.size}"
                )
            if key == "target_tokens":
                check_ids(arr, vocab_size, f"data[{i}].loss_fn_inputs.target_tokens")
            elif not np.all(np.isfinite(arr)):
                raise InvalidArgumentError(
                    f"data[{i}].loss_fn_inputs.{key}: contains NaN or infinity"
                )
        if need_targets and "target_tokens" not in datum.inputs:
            raise InvalidArgumentError(f"data[{i}].loss_fn_inputs.target_tokens: required")


def check_ids(ids: np.ndarray, vocab_size: int, field: str) -> None:
    if ids.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{field}: token ids must be integers")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        raise InvalidArgumentError(
            f"{field}: token id {int(ids[bad][0])} is outside the vocabulary [0, {vocab_size})"
        )


def check_adam(cfg: AdamConfig) -> None:
    checks = {
        "adam_params.learning_rate": cfg.learning_rate >= 0,
        "adam_params.beta1": 0 <= cfg.beta1 < 1,
        "adam_params.beta2": 0 <= cfg.beta2 < 1,
        "adam_params.eps": cfg.eps >= 0,
        "adam_params.weight_decay": cfg.weight_decay >= 0,
        "adam_params.grad_clip_norm": cfg.grad_clip_norm >= 0,
    }
    for field, ok in checks.items():
        if not ok or not np.isfinite(getattr(cfg, field.split(".")[1])):
            raise InvalidArgumentError(f"{field}: out of range")


def common_input_keys(data: Sequence[DatumData]) -> list[str]:
    keys = list(data[0].inputs)
    for i, d in enumerate(data[1:], start=1):
        if set(d.inputs) != set(keys):
            diff = sorted(set(d.inputs) ^ set(keys))
            raise InvalidArgumentError(
                f"data[{i}].loss_fn_inputs: keys differ from data[0] ({diff})"
            )
    return keys


def check_temperature(t: float) -> None:
    if not (np.isfinite(t) and t > 0):
        raise InvalidArgumentError(f"temperature: must be a positive number, got {t}")
