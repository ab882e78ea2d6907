"""Cross-model training batches on a group of ranks (``--ranks N``): several LoRA
models' ``ForwardBackward`` / ``ForwardLogprobs`` calls in one pass through their
base sharded by FSDP2 (``workers.trainer.sharded_base``), each rank running its
share of every call's datums.

Rank 0 checks every call and every share of it, splits each call's datums as a
single call is split (contiguous shares, the larger first) and hands every rank
its shares, in the batch's order (``workers.group``); then every rank runs
``run_shares``: the rows of all its shares in one pass, each with its own
adapter (``LoraRows``, as ``workers.trainer.batching`` does on one rank), through
the sharded base. The adapters are replicated, so each rank adds its shares'
gradients to its own replicas, and the optimizer step sums them over the ranks
(``collectives.sum_gradients``): each adapter gets the gradient of its own calls,
as on one rank. Rank 0 merges each call's per-rank results into one
(``collectives.merge_results``).

What keeps the ranks' collectives in step (FSDP all-gathers each layer in the
forward and again in the backward's recompute): every rank runs the same passes.
The pass without gradients runs on every rank when any rank has rows for it
(``ForwardLogprobs`` rows, the reference rows of a KL penalty; rank 0 says), one
token with no adapter on a rank that has none. The pass with gradients runs when
the batch holds a ``ForwardBackward``, and on every rank it holds a row of every
such call's adapter: one token with a zero loss where the rank's share of that
call is empty or failed, so the backward reaches the same layers on every rank.

A call that fails on a rank (its share's checks, its loss) is left out of the
summed loss on every rank: the failures are all-reduced before the backward, so no
rank's replica holds a gradient the others lack, and the batch's other calls go
on, as on one rank. A failure inside a pass (out of memory, a bug) raises: the
ranks' collectives are then out of step and the group is not used again, as for a
single call (``workers.trainer.fsdp.forward_backward``).

Every function here is a collective: each rank calls it in the same order.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from treadle.common.engine.domain import ForwardBackwardOp, ForwardLogprobsOp
from treadle.errors import InternalError, TreadleError
from treadle.workers.device import device
from treadle.workers.model.lora import LoraAdapter
from treadle.workers.model.params import LlamaParams
from treadle.workers.trainer import trainer
from treadle.workers.trainer.batching import BatchCall, Rows, logprobs_of_rows, stack_rows
from treadle.workers.trainer.fsdp import FsdpShards
from treadle.workers.trainer.trainer import PreparedForwardBackward, TrainBatch

log = logging.getLogger("treadle.batching")


def shared_base(calls: Sequence[BatchCall]) -> FsdpShards:
    """The one sharded frozen base every call's model trains on (else InternalError:
    a batch on a group is of LoRA models on one sharded base)."""
    sharding = calls[0].model.sharding
    if not isinstance(sharding, FsdpShards) or not sharding.frozen:
        raise InternalError(f"model {calls[0].model.spec.model_id}: its base is not sharded")
    for call in calls[1:]:
        if call.model.sharding is not sharding:
            raise InternalError(f"model {call.model.spec.model_id}: not on the batch's base")
    return sharding


def run_shares(calls: Sequence[BatchCall], *, no_grad_pass: bool) -> None:
    """Every rank: its shares of a batch's calls (each ``op`` this rank's share, maybe
    without datums) in one pass through their sharded base; each ``outcome`` set: the
    share's result, None (no datums here), or its failure (a check, its loss).
    ``no_grad_pass``: some rank's share needs the pass without gradients (rank 0
    knows). Raises when a pass fails (the group cannot go on)."""
    sharding = shared_base(calls)
    fb: list[tuple[BatchCall, PreparedForwardBackward | None]] = []
    fl: list[tuple[BatchCall, TrainBatch]] = []
    for call in calls:
        call.outcome = None
        prep: PreparedForwardBackward | None = None
        try:
            if isinstance(call.op, ForwardBackwardOp):
                if call.op.data:
                    prep = trainer.prepare_forward_backward(call.model, call.op)
            elif call.op.data:
                fl.append((call, trainer.prepare_forward_logprobs(call.model, call.op)))
        except Exception as err:  # this share fails alone; the rank still joins the passes
            call.outcome = _as_error(call, err)
        if isinstance(call.op, ForwardBackwardOp):
            fb.append((call, prep))
    try:
        if no_grad_pass:
            _no_grad_pass(sharding, calls[0], fb, fl)
        if fb:
            _grad_pass(sharding, fb)
    except RuntimeError:  # a collective's failure, or out of memory: the group breaks
        raise
    except Exception as err:  # any other: the ranks' collectives are out of step all the same
        raise RuntimeError(f"the batched FSDP pass failed: {type(err).__name__}: {err}") from err


def _no_grad_pass(
    sharding: FsdpShards,
    any_call: BatchCall,
    fb: list[tuple[BatchCall, PreparedForwardBackward | None]],
    fl: list[tuple[BatchCall, TrainBatch]],
) -> None:
    """``ForwardLogprobs`` rows and the reference rows (the adapter off) of KL
    penalties, no gradient; one token on a rank without any."""
    rows: list[Rows] = []
    for call, batch in fl:
        op = call.op
        assert isinstance(op, ForwardLogprobsOp)
        adapter = None if op.reference else call.model.adapter
        rows.append(Rows(call, batch.tokens_B_T, batch.targets_B_T, adapter, op.temperature))
    refs: list[tuple[BatchCall, PreparedForwardBackward]] = []
    for call, prep in fb:
        if prep is not None and prep.needs_reference:
            refs.append((call, prep))
            batch = prep.batch
            rows.append(Rows(call, batch.tokens_B_T, batch.targets_B_T, None, call.op.temperature))
    with torch.no_grad():
        lps = _through(sharding, rows or [_one_token(any_call, None)], with_entropy=False)
    for (call, batch), (lp_B_T, _) in zip(fl, lps[: len(fl)], strict=True):
        call.outcome = trainer.logprobs_result(call.model, batch, lp_B_T)
    for (call, prep), (lp_B_T, _) in zip(refs, lps[len(fl) : len(rows)], strict=True):
        trainer.set_reference(call.model, prep, lp_B_T)


def _grad_pass(
    sharding: FsdpShards, fb: list[tuple[BatchCall, PreparedForwardBackward | None]]
) -> None:
    """Every ``ForwardBackward`` share's rows with its own adapter (one token where the
    share is empty or failed), each call's loss on its rows, and one backward of the
    sum of the losses of the calls no rank failed."""
    rows = []
    for call, prep in fb:
        if prep is None:
            rows.append(_one_token(call, call.model.adapter))
        else:
            batch = prep.batch
            rows.append(
                Rows(call, batch.tokens_B_T, batch.targets_B_T, call.model.adapter, _temp(call))
            )
    lps = _through(sharding, rows, with_entropy=True)
    losses: list[Tensor | None] = []
    for (call, prep), (lp_B_T, entropy_B_T) in zip(fb, lps, strict=True):
        loss = None
        if prep is not None:
            op = call.op
            assert isinstance(op, ForwardBackwardOp)
            try:
                loss, call.outcome = trainer.finish_forward_backward(
                    call.model, op, prep, lp_B_T, entropy_B_T
                )
            except TreadleError as err:
                call.outcome = err
        losses.append(loss)
    where = fb[0][0].model.params.device
    failed = _failed_on_any_rank([isinstance(call.outcome, Exception) for call, _ in fb], where)
    total: Tensor | None = None
    for loss, (lp_B_T, _), bad in zip(losses, lps, failed, strict=True):
        # a zero through the call's rows where it adds nothing: the graph, and so the
        # backward's all-gathers, are the same on every rank
        term = loss if loss is not None and not bad else 0.0 * lp_B_T.sum()
        total = term if total is None else total + term
    assert total is not None
    trainer.accumulate_gradients(total, [call.model for call, _ in fb])


def _through(
    sharding: FsdpShards, rows: list[Rows], *, with_entropy: bool
) -> list[tuple[Tensor, Tensor | None]]:
    """One pass of ``rows`` through the sharded base (each row's adapter on the layers
    and the head); each call's logprobs at its own temperature."""
    tokens_B_T, lora = stack_rows(rows)

    def head(hidden_B_T_H: Tensor, params: LlamaParams) -> list[tuple[Tensor, Tensor | None]]:
        out = logprobs_of_rows(rows, hidden_B_T_H, params, with_entropy=with_entropy)
        # FSDP hooks the backward on the root's outputs: tensors of their own, not
        # views (an in-place op on a view would drop the hook; FSDP warns of views)
        return [(lp_B_T.clone(), entropy_B_T) for lp_B_T, entropy_B_T in out]

    out: list[tuple[Tensor, Tensor | None]] = sharding.root(tokens_B_T, head, lora)
    return out


def _one_token(call: BatchCall, adapter: LoraAdapter | None) -> Rows:
    """A row of one token standing in for a share with none here (its result unused)."""
    zero = torch.zeros((1, 1), dtype=torch.int64, device=call.model.params.device)
    return Rows(call, zero, zero, adapter, 1.0)


def _as_error(call: BatchCall, err: Exception) -> TreadleError:
    """A share's failure as the call's answer (rank 0 gathers it, pickled)."""
    if isinstance(err, TreadleError):
        return err
    if isinstance(err, torch.OutOfMemoryError):
        return device.out_of_memory(call.op.kind, err, call.model.params.device)
    log.error("%s share failed: %s\n%s", call.op.kind, err, traceback.format_exc())
    return InternalError(f"{call.op.kind} failed: {type(err).__name__}: {err}")


def _failed_on_any_rank(failed: list[bool], where: torch.device) -> list[bool]:
    flags = torch.tensor([1 if f else 0 for f in failed], dtype=torch.int64, device=where)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(f) for f in flags.tolist()]


def _temp(call: BatchCall) -> float:
    return call.op.temperature
