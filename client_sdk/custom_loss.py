"""Custom losses without shipping code to the server (tinker's ``forward_backward_custom``).

Any differentiable function of the per-token logprobs can be trained on with the
server's plain ``cross_entropy``:

1. ``forward_logprobs`` returns ``logp_t``, the current policy's log-prob of each
   target (at the request's temperature);
2. the user's torch function maps them to a scalar ``L`` on the client, and
   autograd gives ``g_t = dL/dlogp_t``;
3. ``forward_backward`` with ``cross_entropy`` and per-token weights ``w_t = -g_t``
   accumulates the gradient of ``Σ_t -w_t·logp_t = Σ_t g_t·logp_t`` (``g`` held
   fixed), which is ``Σ_t g_t·∇logp_t = ∇L`` by the chain rule.

The cost is one extra forward pass, and two ``seq_id`` s (the forward, then the
backward). Sequence-level losses, losses that mix several sequences, and anything
else torch can differentiate work, as long as ``L`` depends on the weights only
through the logprobs.

torch is needed on the client for this call only: it is imported here, lazily, so
``import treadle`` never needs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from treadle.errors import InvalidArgumentError
from treadle.futures import APIFuture
from treadle.types import Datum, ForwardBackwardOutput

if TYPE_CHECKING:
    from treadle.training_client import TrainingClient

#: ``loss_fn(data, logprobs_list) -> (loss, metrics)``: ``logprobs_list[i]`` is a 1-D
#: torch tensor (requires grad) of datum i's target logprobs; ``loss`` a scalar tensor.
CustomLossFn = Callable[[Sequence[Datum], list[Any]], "tuple[Any, Mapping[str, Any]]"]


def _torch() -> Any:
    try:
        import torch
    except ImportError as err:  # pragma: no cover - exercised only without torch
        raise ImportError(
            "forward_backward_custom needs torch on the client (pip install torch); "
            "the rest of the SDK does not"
        ) from err
    return torch


def forward_datums(data: Sequence[Datum]) -> list[Datum]:
    """What ``forward_logprobs`` needs: the tokens and targets only (the user's other
    inputs may be anything, they never leave the client)."""
    if not data:
        raise InvalidArgumentError("data: empty batch")
    out = []
    for i, datum in enumerate(data):
        if not isinstance(datum, Datum):
            raise InvalidArgumentError(f"data: expected treadle.Datum, got {type(datum).__name__}")
        if "target_tokens" not in datum.loss_fn_inputs:
            raise InvalidArgumentError(f"data[{i}].loss_fn_inputs.target_tokens: required")
        out.append(
            Datum(datum.model_input, {"target_tokens": datum.loss_fn_inputs["target_tokens"]})
        )
    return out


def evaluate(
    data: Sequence[Datum], forward: ForwardBackwardOutput, loss_fn: CustomLossFn
) -> tuple[list[np.ndarray], float, dict[str, float]]:
    """Run ``loss_fn`` on the logprobs; return the weights ``-dL/dlogp`` per datum, the
    loss value and the user's metrics as floats."""
    torch = _torch()
    logprobs = [
        torch.tensor(np.array(out.logprobs), requires_grad=True) for out in forward.loss_fn_outputs
    ]
    result = loss_fn(data, logprobs)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise InvalidArgumentError("loss_fn: must return (loss, metrics)")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise InvalidArgumentError("loss_fn: the loss must be a scalar torch tensor")
    value = float(loss.detach())
    if not math.isfinite(value):
        raise InvalidArgumentError(f"loss_fn: the loss is {value}")
    grads = (
        torch.autograd.grad(loss.reshape(()), logprobs, allow_unused=True)
        if loss.requires_grad
        else [None] * len(logprobs)
    )
    weights = []
    for i, (lp, grad) in enumerate(zip(logprobs, grads, strict=True)):
        g = torch.zeros_like(lp) if grad is None else grad
        w = (-g).detach().cpu().numpy()  # the logprobs' dtype: float64 for a float64 model
        if not np.isfinite(w).all():
            raise InvalidArgumentError(
                f"loss_fn: the gradient with respect to data[{i}]'s logprobs is not finite"
            )
        weights.append(w)
    return weights, value, {str(k): _as_float(k, v) for k, v in dict(metrics or {}).items()}


def _as_float(key: Any, value: Any) -> float:
    try:
        return float(value.detach()) if hasattr(value, "detach") else float(value)
    except (TypeError, ValueError) as err:
        raise InvalidArgumentError(f"loss_fn: metric {key!r} is not a number: {err}") from err


def backward_datums(data: Sequence[Datum], weights: Sequence[np.ndarray]) -> list[Datum]:
    """The ``cross_entropy`` datums whose gradient is the user's loss's gradient."""
    return [
        Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": w})
        for d, w in zip(data, weights, strict=True)
    ]


def merge(
    output: ForwardBackwardOutput, loss: float, metrics: Mapping[str, float]
) -> ForwardBackwardOutput:
    """The server's output with ``loss:sum`` = the user's loss (not the surrogate's
    value, which means nothing) and the user's metrics added."""
    merged = {k: v for k, v in output.metrics.items() if k != "loss:sum"}
    merged.update(metrics)
    merged["loss:sum"] = loss
    return ForwardBackwardOutput(loss_fn_outputs=output.loss_fn_outputs, metrics=merged)


def forward_backward_custom(
    client: TrainingClient,
    data: Sequence[Datum],
    loss_fn: CustomLossFn,
    *,
    temperature: float = 1.0,
) -> APIFuture[ForwardBackwardOutput]:
    """See ``TrainingClient.forward_backward_custom``."""
    forward = client.forward_logprobs(forward_datums(data), temperature=temperature).result()
    weights, loss, metrics = evaluate(data, forward, loss_fn)
    backward = client.forward_backward(
        backward_datums(data, weights), "cross_entropy", temperature=temperature
    )
    return backward.then(lambda out: merge(out, loss, metrics))


async def forward_backward_custom_async(
    client: TrainingClient,
    data: Sequence[Datum],
    loss_fn: CustomLossFn,
    *,
    temperature: float = 1.0,
) -> ForwardBackwardOutput:
    """See ``TrainingClient.forward_backward_custom_async``."""
    forward = await client.forward_logprobs(forward_datums(data), temperature=temperature)
    weights, loss, metrics = evaluate(data, forward, loss_fn)
    out = await client.forward_backward(
        backward_datums(data, weights), "cross_entropy", temperature=temperature
    )
    return merge(out, loss, metrics)
