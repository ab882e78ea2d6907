"""The loss registry: every objective ``ForwardBackward`` can run, as pure functions.

Why a registry of pure functions: the trainer stays one loop (forward, call the
registered function, backward) and each objective can be unit-tested on tiny
tensors without a model. The engine flattens a batch's next-token targets into
one vector of N tokens (the tinker alignment: position t of a datum's
``loss_fn_inputs`` refers to the target predicted from ``model_input[..t]``),
computes the current policy's log-prob of each target at the request
temperature, and calls :func:`compute_loss`.

Contracts kept here (DESIGN.md):

* **Losses are sums.** Every loss is ``Σ_t w_t · ℓ_t`` with no hidden
  denominator, so several ``ForwardBackward`` calls before one ``OptimStep``
  add up to the same gradient as one call. Normalisation (token mean, GRPO's
  sequence mean, Dr.GRPO's constant) is the client's job: ``treadle.rl``
  scales ``weights``.
* **Masking.** Tokens with ``w_t == 0`` (prompt targets) contribute nothing and
  are left out of every ``:mean``/``:min``/``:max`` metric. Log-ratios are
  zeroed on those tokens *before* ``exp`` so that a garbage value there (the
  behaviour log-prob of a prompt token is 0 by convention) can never produce
  ``0 · inf = nan``.
* **Names follow tinker**: ``clip_low_threshold``/``clip_high_threshold`` are
  ratio thresholds; defaults match the tinker docs and cookbook (PPO 0.8/1.2,
  CISPO 0.0/4.0).
"""

from __future__ import annotations

from treadle.common.engine.losses import KNOWN_INPUTS, UNSERVED, unserved_loss
from treadle.workers.trainer.losses.base import (
    ENGINE_INPUTS,
    LossBatch,
    LossFn,
    LossResult,
    LossSpec,
    cross_entropy,
)
from treadle.workers.trainer.losses.policy import cispo, dro, gspo, importance_sampling, ppo
from treadle.workers.trainer.losses.registry import (
    LOSSES,
    compute_loss,
    needs_reference,
    validate_loss_request,
)

__all__ = [
    "ENGINE_INPUTS",
    "KNOWN_INPUTS",
    "LOSSES",
    "LossBatch",
    "LossFn",
    "LossResult",
    "LossSpec",
    "UNSERVED",
    "cispo",
    "compute_loss",
    "cross_entropy",
    "dro",
    "gspo",
    "importance_sampling",
    "needs_reference",
    "ppo",
    "unserved_loss",
    "validate_loss_request",
]
