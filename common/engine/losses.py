"""The losses the engine serves, as a server must know them without torch: each
loss's name, the inputs it reads and its config keys with their defaults, the
names the tinker SDK can send that treadle refuses (and why), and the refusal.

The trainer registers a function under each name (``treadle.workers.trainer.
losses``); a test checks that the two registries cover each other and the
proto's ``LossFn`` enum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from treadle.errors import InvalidArgumentError


@dataclass(frozen=True)
class LossContract:
    """A served loss as callers see it: the inputs it reads and its config keys."""

    name: str
    required_inputs: frozenset[str]
    optional_inputs: frozenset[str]
    config_defaults: Mapping[str, float]

    @property
    def known_inputs(self) -> frozenset[str]:
        return self.required_inputs | self.optional_inputs


_POLICY_REQUIRED = frozenset({"target_tokens", "logprobs", "advantages"})
_POLICY_OPTIONAL = frozenset({"weights", "ref_logprobs"})
_DECOUPLED = frozenset({"proximal_logprobs"})

CONTRACTS: Mapping[str, LossContract] = MappingProxyType(
    {
        "cross_entropy": LossContract(
            "cross_entropy",
            required_inputs=frozenset({"target_tokens", "weights"}),
            optional_inputs=frozenset(),
            config_defaults=MappingProxyType({}),
        ),
        "importance_sampling": LossContract(
            "importance_sampling",
            required_inputs=_POLICY_REQUIRED,
            optional_inputs=_POLICY_OPTIONAL,
            config_defaults=MappingProxyType({"kl_beta": 0.0, "ratio_cap": 0.0}),
        ),
        "ppo": LossContract(
            "ppo",
            required_inputs=_POLICY_REQUIRED,
            optional_inputs=_POLICY_OPTIONAL | _DECOUPLED,
            config_defaults=MappingProxyType(
                {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "kl_beta": 0.0}
            ),
        ),
        "cispo": LossContract(
            "cispo",
            required_inputs=_POLICY_REQUIRED,
            optional_inputs=_POLICY_OPTIONAL | _DECOUPLED,
            config_defaults=MappingProxyType(
                {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0, "kl_beta": 0.0}
            ),
        ),
        "dro": LossContract(
            "dro",
            required_inputs=_POLICY_REQUIRED,
            optional_inputs=_POLICY_OPTIONAL,
            config_defaults=MappingProxyType({"beta": 0.05, "kl_beta": 0.0}),
        ),
        "gspo": LossContract(
            "gspo",
            required_inputs=_POLICY_REQUIRED,
            optional_inputs=_POLICY_OPTIONAL | frozenset({"sequence_ratio_mask"}),
            # The GSPO paper's clip range (epsilon 3e-4 / 4e-4): a sequence ratio is a
            # geometric mean, so it strays from 1 far less than a token ratio does.
            config_defaults=MappingProxyType(
                {"clip_low_threshold": 0.9997, "clip_high_threshold": 1.0004, "kl_beta": 0.0}
            ),
        ),
    }
)

#: Losses the tinker SDK can name that treadle refuses, and why (the refusal says it).
UNSERVED: Mapping[str, str] = MappingProxyType(
    {
        "stable_reinforce": (
            "its objective is not public: tinker documents it as an alpha loss computed "
            "from stability information its own sampler records (record_stability_info=True, "
            "named by sequence_id) and never returns to the client, so no server outside "
            "tinker can compute the same quantity; use ppo, cispo or gspo for off-policy "
            "data, or forward_backward_custom for an objective of your own"
        ),
    }
)

#: Every input name some loss reads; anything else is a typo and is rejected.
KNOWN_INPUTS = frozenset().union(*(c.known_inputs for c in CONTRACTS.values()))


def unserved_loss(name: str) -> InvalidArgumentError:
    """The refusal of a loss name treadle does not serve: why, when it is one the
    tinker SDK can send, and the served ones either way."""
    if name in UNSERVED:
        return InvalidArgumentError(
            f"loss_fn: {name!r} is not served by treadle: {UNSERVED[name]} "
            f"(served: {sorted(CONTRACTS)})"
        )
    return InvalidArgumentError(
        f"loss_fn: unknown loss {name!r}; expected one of {sorted(CONTRACTS)}"
    )
