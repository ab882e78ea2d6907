"""The pieces a loop is made of: the prompt source's :class:`Prompt`, a
:class:`Group` of rollouts, the :class:`StepStats` a loop yields, and the usual
train step, :func:`grpo_train_step` (group-centred advantages, a policy loss,
minibatches). The loops (``treadle.rl.loops``, ``treadle.rl.sweep``) drive
them; a train step is any callable ``(trainer, groups) -> metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from treadle.errors import InvalidArgumentError
from treadle.rl.advantages import group_advantages
from treadle.rl.datums import Rollout, build_datums
from treadle.rl.metrics import merge_metrics
from treadle.types import AdamParams, Datum, SampledSequence, SamplingParams

if TYPE_CHECKING:
    from treadle.training_client import TrainingClient

#: DAPO's asymmetric clip (ratio thresholds).
PPO_CLIP: Mapping[str, float] = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}


@dataclass(frozen=True)
class Prompt:
    """One prompt of the prompt source: its tokens, what the reward needs, its sampling params."""

    tokens: Sequence[int]
    task: Any = None
    sampling_params: SamplingParams | None = None


@dataclass(frozen=True)
class Group:
    """One prompt's G rollouts (one ``sample`` request), rewards filled in; or one
    group of agent episodes, each as a masked rollout (``Episode.to_rollout``),
    failed episodes left out (so groups may differ in size)."""

    prompt: Prompt
    rollouts: list[Rollout]
    #: an episode group's episodes, the failed ones included (``Episode.error``)
    episodes: Sequence[Any] = ()


RewardFn = Callable[[Any, SampledSequence], float]
#: ``train_step(trainer, groups) -> metrics``; it may set ``metrics["version"]``
#: (the optimizer steps applied after it), else the loop asks the server.
TrainStep = Callable[["TrainingClient", list[Group]], dict[str, float]]


@dataclass
class StepStats:
    """What one training step saw: the signals to watch while a loop runs.

    ``metrics`` are the train step's, under the server's names
    (:func:`~treadle.rl.merge_metrics` over the step's calls: ``loss:sum``,
    ``ntokens:sum``, ``clip_frac:mean``, ``ratio:mean``/``:min``/``:max``,
    ``kl_ref:mean`` with a KL penalty, ``grad_norm:value``, ...), plus
    ``trained_rollouts`` (rollouts in groups whose rewards disagree: the others
    have zero advantage and are not sent) and ``version``.
    """

    step: int
    version: int  # trainer version after the step
    groups: int
    rollouts: int
    trained_tokens: int  # completion tokens in the batch trained on
    reward: float  # mean reward of the batch
    staleness: dict[int, int]  # rollout staleness (at train time, in steps) -> count
    dropped_stale: int  # rollouts dropped for staleness before this step
    wait_data_s: float  # the trainer waited this long for rollouts
    sampler_wait_s: float  # the sampler had nothing allowed to run (weights / back-pressure)
    step_s: float
    occupancy: float | None = None  # the sampler's slot occupancy (server metrics), if reported
    metrics: dict[str, float] = field(default_factory=dict)
    #: episodes that ended on bad input or a raising tool (not trained on), episode loops only
    failed_episodes: int = 0


# ---- the train step --------------------------------------------------------------------


def grpo_train_step(
    *,
    loss: str = "ppo",
    loss_config: Mapping[str, float] | None = None,
    adam: AdamParams | None = None,
    minibatches: int = 1,
    temperature: float = 1.0,
    proximal: bool = False,
) -> GrpoTrainStep:
    """A GRPO train step: group-centred advantages, ``minibatches`` optimizer steps.

    The ratio's denominator is the sampler's behaviour logprobs, so the loss
    corrects staleness by importance sampling (``ppo`` clips it,
    ``importance_sampling`` reweights it). ``proximal=True`` is decoupled PPO
    (AReaL): the trainer's current logprobs (``forward_logprobs``) go in as
    ``proximal_logprobs``, the clip centres on them and the behaviour weight
    ``exp(proximal - behaviour)`` corrects the rest.
    """
    if minibatches < 1:
        raise InvalidArgumentError(f"minibatches: must be >= 1, got {minibatches}")
    config = dict(PPO_CLIP if loss_config is None and loss == "ppo" else (loss_config or {}))
    return GrpoTrainStep(
        loss, config, adam or AdamParams(learning_rate=3e-4), minibatches, temperature, proximal
    )


@dataclass(frozen=True)
class GrpoTrainStep:
    """:func:`grpo_train_step`'s step. Calling it trains and returns the metrics;
    :meth:`submit` sends the same calls and returns at once, so many runs' steps
    can be in flight together from one thread (:func:`treadle.rl.sweep_loop`)."""

    loss: str
    loss_config: Mapping[str, float]
    adam: AdamParams
    minibatches: int
    temperature: float
    proximal: bool

    def __call__(self, trainer: TrainingClient, groups: list[Group]) -> dict[str, float]:
        return self.submit(trainer, groups)()

    def submit(
        self, trainer: TrainingClient, groups: list[Group]
    ) -> Callable[[], dict[str, float]]:
        """Send the step's ``forward_backward`` / ``optim_step`` calls; the function
        returned waits for them and gives the metrics. (With ``proximal``, the
        ``forward_logprobs`` it needs first is waited for here.)"""
        return self.send(trainer, self.prepare(groups))

    def prepare(self, groups: list[Group]) -> list[tuple[list[Datum], int]]:
        """The step's client-side work, sending nothing: each minibatch's datums
        (advantages, one denominator a step) and the rollouts trained on.
        :func:`treadle.rl.sweep_loop` prepares every run's step before it sends
        any, so the runs' calls reach the server close together."""
        rollouts = [r for g in groups for r in g.rollouts]
        # each group centred on its own mean: groups may differ in size (an
        # episode group whose failed episodes were left out)
        adv_B = np.concatenate(
            [np.zeros(0)]
            + [
                group_advantages([r.reward for r in g.rollouts], len(g.rollouts))
                for g in groups
                if g.rollouts
            ]
        )
        keep = [i for i, a in enumerate(adv_B) if a != 0.0 and rollouts[i].trained_tokens]
        if not keep:
            return []
        order = np.random.permutation(keep)
        return [
            (build_datums([rollouts[i] for i in mb], adv_B[mb]), len(keep))
            for mb in np.array_split(order, min(self.minibatches, len(order)))
        ]

    def send(
        self, trainer: TrainingClient, prepared: list[tuple[list[Datum], int]]
    ) -> Callable[[], dict[str, float]]:
        """Send what :meth:`prepare` made; the function returned waits for it."""
        if not prepared:
            return lambda: {"loss:sum": 0.0, "trained_rollouts": 0.0}
        fbs, opts = [], []
        for datums, _ in prepared:
            if self.proximal:
                datums = _with_proximal(trainer, datums, self.temperature)
            fbs.append(
                trainer.forward_backward(
                    datums, self.loss, dict(self.loss_config), temperature=self.temperature
                )
            )
            opts.append(trainer.optim_step(self.adam))

        def finish() -> dict[str, float]:
            steps = [o.result() for o in opts]
            out = merge_metrics([f.result().metrics for f in fbs] + [s.metrics for s in steps])
            out["version"] = float(steps[-1].step)
            out["trained_rollouts"] = float(prepared[0][1])
            return out

        return finish


def _with_proximal(trainer: TrainingClient, datums: list[Datum], temperature: float) -> list[Datum]:
    out = trainer.forward_logprobs(datums, temperature=temperature).result()
    return [
        replace(d, loss_fn_inputs={**d.loss_fn_inputs, "proximal_logprobs": o.logprobs})
        for d, o in zip(datums, out.loss_fn_outputs, strict=True)
    ]
