"""From rollouts to training datums: the next-token shift, the mask, and the one denominator.

The server sums (docs/losses.md, "The rules every loss keeps"): a
``ForwardBackward`` loss is ``Σ_t w_t · ℓ_t`` with no hidden mean, and several calls before one
``OptimStep`` just add gradients. Every normalisation therefore lives here, as
ONE denominator per optimizer step folded into ``weights``. Because each
datum's weights already carry that denominator, any split of the step's datums
into minibatches, sent as separate ``forward_backward`` calls and summed by
gradient accumulation, gives exactly the gradient of one call with all of them.
A per-call mean would not: two calls of 10 and 1000 tokens would weigh each
token of the small call 100 times more.

So call :func:`build_datums` once per optimizer step, on all the rollouts that
step trains on, then split the datums however memory requires.

Scaling ``weights`` (not ``advantages``) scales every term of every loss by the
same factor: the surrogate, DRO's quadratic penalty and the KL-to-reference
penalty alike. Scaling only advantages would leave the penalties unnormalised.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from treadle.errors import InvalidArgumentError
from treadle.rl.staleness import Versions, count_versions, expand_versions
from treadle.types import Datum, ModelInput, SampledSequence, to_numpy

Aggregation = Literal["token_mean", "seq_mean_token_mean", "token_sum_constant", "sum"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "token_sum_constant", "sum")


@dataclass(frozen=True)
class Rollout:
    """One sampled completion and what the client learned about it.

    ``completion_logprobs`` are the behaviour (sampler) log-probs, one per
    completion token; ``versions`` are the weight versions that wrote the
    completion (``VersionSpan`` s as the sampler returns them, or one int per
    token; empty when unknown); ``ref_logprobs`` optional reference log-probs,
    one per completion token.

    ``mask`` (one per completion token, 1 or 0) marks which completion tokens
    are trained on: an agent episode (``treadle.rl.episodes``) lays its turns out
    as one completion, the model's tokens with mask 1 and the environment's
    observations (tool outputs included) with mask 0 (weight 0 in the datum).
    ``None`` trains on every completion token.
    """

    prompt_tokens: Sequence[int]
    completion_tokens: Sequence[int]
    completion_logprobs: Sequence[float]
    reward: float = 0.0
    versions: Versions = ()
    ref_logprobs: Sequence[float] | None = None
    mask: Sequence[float] | None = None

    def __post_init__(self) -> None:
        prompt = (
            self.prompt_tokens.tokens
            if isinstance(self.prompt_tokens, ModelInput)
            else self.prompt_tokens
        )
        n = len(self.completion_tokens)
        object.__setattr__(self, "prompt_tokens", tuple(map(int, prompt)))
        object.__setattr__(self, "completion_tokens", tuple(map(int, self.completion_tokens)))
        object.__setattr__(
            self, "completion_logprobs", _floats(self.completion_logprobs, n, "completion_logprobs")
        )
        object.__setattr__(self, "versions", tuple(self.versions))
        if self.versions and count_versions(self.versions, field_name="rollout.versions") != n:
            raise InvalidArgumentError(f"rollout.versions: must cover the {n} completion tokens")
        if self.ref_logprobs is not None:
            object.__setattr__(self, "ref_logprobs", _floats(self.ref_logprobs, n, "ref_logprobs"))
        if self.mask is not None:
            mask = _floats(self.mask, n, "mask")
            if any(m not in (0.0, 1.0) for m in mask):
                raise InvalidArgumentError("rollout.mask: every value must be 0 or 1")
            object.__setattr__(self, "mask", mask)

    @property
    def trained_tokens(self) -> int:
        """Completion tokens trained on: all of them, or the mask's ones."""
        if self.mask is None:
            return len(self.completion_tokens)
        return int(sum(self.mask))

    @classmethod
    def from_sequence(
        cls,
        prompt_tokens: Sequence[int] | ModelInput,
        sequence: SampledSequence,
        reward: float = 0.0,
        ref_logprobs: Sequence[float] | None = None,
    ) -> Rollout:
        """A rollout from one of ``Sample``'s sequences (tokens, logprobs and versions carried over)."""
        if isinstance(prompt_tokens, ModelInput):
            prompt_tokens = prompt_tokens.tokens
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=sequence.tokens,
            completion_logprobs=sequence.logprobs,
            reward=reward,
            versions=sequence.versions,
            ref_logprobs=ref_logprobs,
        )

    def token_versions(self) -> list[int]:
        return [int(v) for v in expand_versions(self.versions)]


def _floats(values: Sequence[float] | Any, n: int, name: str) -> tuple[float, ...]:
    out = _plain_floats(values)
    if out is None:
        arr = to_numpy(values, dtype=np.float64, field_name=f"rollout.{name}")
        out = tuple(arr.tolist())
    if len(out) != n:
        raise InvalidArgumentError(f"rollout.{name}: {len(out)} values for {n} completion tokens")
    # a NaN or inf makes the sum one; a finite sum needs no look at each value
    if not math.isfinite(sum(out)) and not all(map(math.isfinite, out)):
        raise InvalidArgumentError(f"rollout.{name}: contains NaN or inf")
    return out


_PLAIN_NUMBERS = frozenset({float, int})


def _plain_floats(values: Any) -> tuple[float, ...] | None:
    """A list or tuple of Python floats and ints as floats, without numpy (the
    sampler's lists: a few values each, where numpy's per-call cost dominates);
    None for anything else, which goes through ``to_numpy``."""
    if type(values) is not list and type(values) is not tuple:
        return None
    if not _PLAIN_NUMBERS.issuperset(map(type, values)):
        return None
    try:
        return tuple(map(float, values))
    except OverflowError:  # an int past float64: numpy's error, as before
        return None


def _weight_scales(
    lengths: Sequence[int], aggregation: str, loss_constant: float | None
) -> list[float]:
    """The per-sequence factor each completion token's weight gets (one denominator per step)."""
    if aggregation not in AGGREGATIONS:
        raise InvalidArgumentError(
            f"aggregation: unknown mode {aggregation!r}; expected one of {list(AGGREGATIONS)}"
        )
    if aggregation == "token_sum_constant":
        if loss_constant is None or not math.isfinite(loss_constant) or loss_constant <= 0:
            raise InvalidArgumentError(
                f"loss_constant: aggregation 'token_sum_constant' needs a finite constant > 0 "
                f"(e.g. max_tokens), got {loss_constant!r}"
            )
        return [1.0 / loss_constant] * len(lengths)
    if loss_constant is not None:
        raise InvalidArgumentError(
            f"loss_constant: only used with aggregation 'token_sum_constant', not {aggregation!r}"
        )
    if aggregation == "sum":
        return [1.0] * len(lengths)
    if aggregation == "token_mean":
        total = sum(lengths)
        return [1.0 / total if total else 0.0] * len(lengths)
    # seq_mean_token_mean: the mean over sequences of each sequence's token mean.
    # Empty completions have no token mean and are not counted.
    n_seqs = sum(1 for n in lengths if n)
    return [1.0 / (n * n_seqs) if n else 0.0 for n in lengths]


def build_datums(
    rollouts: Iterable[Rollout],
    advantages: Sequence[float] | np.ndarray | Any,
    *,
    aggregation: Aggregation = "token_mean",
    loss_constant: float | None = None,
    include_logprobs: bool = True,
) -> list[Datum]:
    """One :class:`~treadle.types.Datum` per rollout, ready for ``forward_backward``.

    With ``full = prompt + completion`` (P + C tokens), the datum has
    ``model_input = full[:-1]`` and per-position arrays of length P + C - 1 aligned
    to the next-token target ``full[1:]``. Positions ``P-1 ..`` predict completion
    tokens: there ``weights`` is the aggregation factor, ``logprobs`` the
    behaviour log-probs and ``advantages`` the rollout's advantage; prompt targets
    get 0 in all three, and so do completion tokens whose ``mask`` is 0 (an
    episode's observations). ``ref_logprobs`` is added the same way when every rollout
    has them. ``include_logprobs=False`` leaves ``logprobs`` out (cross_entropy
    needs only ``target_tokens`` and ``weights``).

    Aggregation (the denominator folded into ``weights``; ``rollouts`` must be
    everything ONE optimizer step trains on):

    * ``token_mean``: ÷ total completion tokens of the step (DAPO; Dr.GRPO's token level).
    * ``seq_mean_token_mean``: sequence i ÷ (C_i × number of non-empty sequences) (original GRPO).
    * ``token_sum_constant``: ÷ ``loss_constant`` (Dr.GRPO: a constant such as
      max_tokens, or max_tokens × sequences for its sequence mean).
    * ``sum``: no scaling.
    """
    rollouts = list(rollouts)
    adv_B = to_numpy(advantages, dtype=np.float64, field_name="advantages")
    if adv_B.size != len(rollouts):
        raise InvalidArgumentError(f"advantages: {adv_B.size} values for {len(rollouts)} rollouts")
    if not np.isfinite(adv_B).all():
        raise InvalidArgumentError("advantages: contains NaN or inf")
    with_ref = [r.ref_logprobs is not None for r in rollouts]
    if any(with_ref) and not all(with_ref):
        missing = with_ref.index(False)
        raise InvalidArgumentError(
            f"rollouts[{missing}].ref_logprobs: missing while other rollouts have them"
        )

    scales = _weight_scales([r.trained_tokens for r in rollouts], aggregation, loss_constant)
    return [
        _datum(i, rollout, float(adv), scale, include_logprobs)
        for i, (rollout, adv, scale) in enumerate(zip(rollouts, adv_B, scales, strict=True))
    ]


def _datum(
    i: int, rollout: Rollout, advantage: float, scale: float, include_logprobs: bool
) -> Datum:
    n_prompt = len(rollout.prompt_tokens)
    if n_prompt == 0:
        raise InvalidArgumentError(
            f"rollouts[{i}].prompt_tokens: empty; the first completion token must be predicted "
            "from at least one prompt token (e.g. BOS)"
        )
    full = (*rollout.prompt_tokens, *rollout.completion_tokens)
    n_positions = len(full) - 1
    if n_positions == 0:
        raise InvalidArgumentError(
            f"rollouts[{i}]: a one-token prompt and no completion leave nothing to train on"
        )
    first = n_prompt - 1  # the position whose target is the first completion token

    mask = rollout.mask
    if mask is None:
        # every value times a mask of ones is itself: no product to take

        def per_position(completion_values: Sequence[float] | float) -> np.ndarray:
            out = np.zeros(n_positions, dtype=np.float32)
            out[first:] = completion_values
            return out

    else:
        mask_C = np.asarray(mask, dtype=np.float64)

        def per_position(completion_values: Sequence[float] | float) -> np.ndarray:
            out = np.zeros(n_positions, dtype=np.float32)
            # the product keeps a masked token's sign (-0.0 for a negative advantage)
            out[first:] = np.asarray(completion_values, dtype=np.float64) * mask_C
            return out

    inputs: dict[str, np.ndarray] = {
        "target_tokens": np.array(full[1:], dtype=np.int64),
        "weights": per_position(scale),
        "advantages": per_position(advantage),
    }
    if include_logprobs:
        inputs["logprobs"] = per_position(rollout.completion_logprobs)
    if rollout.ref_logprobs is not None:
        inputs["ref_logprobs"] = per_position(rollout.ref_logprobs)
    return Datum(model_input=ModelInput(full[:-1]), loss_fn_inputs=inputs)
