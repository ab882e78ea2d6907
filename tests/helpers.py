"""Small builders the tests share (one definition each)."""

from __future__ import annotations

from collections.abc import Sequence

import treadle


def char_ids(text: str) -> list[int]:
    """``text`` in the tiny model's character ids (``workers.model.tiny``)."""
    return [3 + (ord(c) - 32) for c in text]


def next_token_datum(
    tokens: Sequence[int], weights: Sequence[float] | None = None
) -> treadle.Datum:
    """A datum that trains each token on the next one: inputs ``tokens[:-1]``,
    targets ``tokens[1:]``, weights 1 unless given."""
    tokens = [int(t) for t in tokens]
    n = len(tokens) - 1
    return treadle.Datum(
        model_input=treadle.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": list(weights) if weights is not None else [1.0] * n,
        },
    )
