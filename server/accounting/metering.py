"""Quotas and usage around the calls that reach the engine: what the servicers
call before a call is dispatched (admit), after it ends (release), and once it
is applied (count).

Ordered calls are counted when their op row goes from pending to done, the one
place a call is applied exactly once, so a client's retry is never counted
twice. A repeat of a recorded ``seq_id`` is not admitted against the quota again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from treadle.common.engine.domain import (
    OrderedOp,
    RejectedOp,
    SampleOp,
    SampleResult,
    SamplerTarget,
    token_cost,
)
from treadle.errors import ResourceExhaustedError
from treadle.server.accounting.quotas import Quotas, Ticket
from treadle.server.accounting.usage import UsageMeter
from treadle.server.db.tenancy import UsageDelta

#: sample calls remembered as counted (a retry comes within seconds of its call)
MAX_COUNTED_SAMPLES = 65536


def sample_reservation(op: SampleOp) -> int:
    """The most tokens a sample can process: its prompt and every sample at max_tokens."""
    return int(op.prompt.size) + op.num_samples * max(op.params.max_tokens, 0)


class CallMeter:
    def __init__(self, quotas: Quotas, usage: UsageMeter | None) -> None:
        self.quotas = quotas
        self.usage = usage
        #: model_id -> seq_ids admitted and not yet finished
        self._in_flight: dict[str, set[int]] = {}
        #: (sampler_id, seq_id, payload digest) of samples already counted: a
        #: client's retry gets the first call's result (the engine shares it) and
        #: is not counted again (remembered per server process, the latest ones)
        self._counted_samples: OrderedDict[tuple[str, int, str], None] = OrderedDict()

    # ---- ordered calls --------------------------------------------------------------

    def admit_ordered(
        self, tenant_id: str, model_id: str, seq_id: int, op: OrderedOp
    ) -> tuple[Ticket | None, OrderedOp]:
        """The call's ticket, and the op to dispatch.

        Over a quota that waiting relieves: RESOURCE_EXHAUSTED with a retry delay,
        and the client retries this ``seq_id``. Over one it never will (more tokens
        than a request may have): the op becomes a ``RejectedOp`` that fails with
        RESOURCE_EXHAUSTED but takes its ``seq_id``, as bad input does, so the
        model's later calls do not wait for it. A call that later admitted calls of
        the model wait for is always let in (see ``Quotas.begin``)."""
        admitted = self._in_flight.setdefault(model_id, set())
        unblocks = any(seq > seq_id for seq in admitted)
        try:
            ticket = self.quotas.begin(tenant_id, token_cost(op), unblocks_others=unblocks)
        except ResourceExhaustedError as err:
            if not admitted:
                del self._in_flight[model_id]
            if err.retry_after_s is not None:
                raise
            return None, RejectedOp(err, kind=op.kind)
        admitted.add(seq_id)
        return ticket, op

    def release_ordered(self, model_id: str, seq_id: int, ticket: Ticket | None) -> None:
        if ticket is None:
            return
        self.quotas.end(ticket)
        admitted = self._in_flight.get(model_id)
        if admitted is not None:
            admitted.discard(seq_id)
            if not admitted:
                del self._in_flight[model_id]

    def count_ordered(self, tenant_id: str, model_id: str, op: OrderedOp, result: Any) -> None:
        if self.usage is None:
            return
        tokens = token_cost(op)
        self.usage.add(
            tenant_id,
            UsageDelta(
                tokens_trained=tokens if op.kind == "forward_backward" else 0,
                tokens_scored=tokens if op.kind == "forward_logprobs" else 0,
                calls=1,
                compute_s=float(getattr(result, "compute_s", 0.0)),
            ),
            model_id=model_id,
        )

    # ---- samples --------------------------------------------------------------------

    def admit_sample(self, tenant_id: str, op: SampleOp) -> Ticket:
        return self.quotas.begin(tenant_id, sample_reservation(op))

    def end_sample(
        self,
        tenant_id: str,
        target: SamplerTarget,
        op: SampleOp,
        ticket: Ticket,
        result: SampleResult | None,
        key: tuple[str, int, str] | None = None,
    ) -> None:
        """Settle the reservation with what was generated; count a sample that ran.

        ``key`` (sampler_id, seq_id, digest) marks a call a client may repeat: a
        repeat of a counted key generated nothing new and is neither charged to
        the quota nor counted again."""
        if result is not None and key is not None:
            if key in self._counted_samples:
                self.quotas.end(ticket, used_tokens=0)
                return
            self._counted_samples[key] = None
            while len(self._counted_samples) > MAX_COUNTED_SAMPLES:
                self._counted_samples.popitem(last=False)
        generated = sum(int(s.tokens.size) for s in result.sequences) if result else 0
        resumed = int(getattr(result, "resumed_tokens", 0))  # prefilled again, not sampled
        generated -= resumed
        self.quotas.end(ticket, used_tokens=int(op.prompt.size) + resumed + generated)
        if result is None or self.usage is None:
            return
        self.usage.add(
            tenant_id,
            UsageDelta(
                tokens_sampled=generated,
                calls=1,
                compute_s=float(getattr(result, "compute_s", 0.0)),
            ),
            model_id=target.model_id or "",
            base_model=target.base_model,
        )
