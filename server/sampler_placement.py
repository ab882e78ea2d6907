"""Where a sampler samples: the one rule, pure, for every dispatcher.

A server has a ``--sampler-placement`` (``colocated``, ``pool`` or ``auto``); a
sampler may choose its own at creation, which wins. ``colocated`` samples on the
model's worker; ``pool`` on the sampler workers serving the base, and with none
of them, UNAVAILABLE naming the base model and the setting that asked for the
pool; ``auto`` on the pool when one serves the base, else colocated. An embedded
server has no pool: its samplers are colocated, and one that asks for ``pool``
is refused the same way. UNAVAILABLE is the answer of a sample (its pool workers
may come back); the service refuses a new sampler that chose ``pool`` with the
same message as FAILED_PRECONDITION (``SamplingService._refuse_unplaceable``).
"""

from __future__ import annotations

from treadle.errors import UnavailableError


def samples_on_pool(server: str, chosen: str, base_model: str, pool_serves_base: bool) -> bool:
    """Whether a sampler of ``base_model`` samples on the pool now. ``server``: the
    server's placement; ``chosen``: the sampler's own ("" = the server's);
    ``pool_serves_base``: whether a live sampler worker serves ``base_model``."""
    placement = chosen or server
    if placement == "colocated":
        return False
    if pool_serves_base:
        return True
    if placement == "pool":
        asked = "the sampler's placement pool" if chosen else "--sampler-placement pool"
        raise UnavailableError(
            f"no sampler worker serves base model {base_model!r} ({asked}); start one: "
            f"treadle worker --role sampler --model {base_model}=DIR --broker ..."
        )
    return False
