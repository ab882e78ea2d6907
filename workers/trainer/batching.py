"""Cross-model training batches: several LoRA models' calls in one pass.

Every LoRA model of a worker shares the frozen base weights, so the
``ForwardBackward`` and ``ForwardLogprobs`` calls of different models (up to
each model's next barrier, as the scheduler hands them out) can run as one
forward: the base matmuls once for every row, each row's low-rank update from
its own adapter (``LoraRows``: each adapter's products on its own rows only).
Each call keeps its own loss, computed on its own rows only, so the one ``backward()`` of the summed losses gives every
adapter exactly the gradient of its own call(s): the same numbers, within
floating-point reordering, as running each call alone (``trainer``). Nothing in
the pass mixes rows of different calls, so a NaN or inf in one call (a diverged
adapter, an overflowing loss) stays in that call's results and its own adapter's
gradient.

Each call is validated on its own first (``trainer.prepare_*``): a bad call
fails alone and never enters the batch. A call whose loss fails after the
forward is dropped from the sum, which leaves no gradient behind.

Two passes at most: one without gradients (``ForwardLogprobs`` rows, and the
reference rows of losses with a KL penalty, base weights only) and one with
(``ForwardBackward`` rows). Full fine-tunes are never batched across models:
their base weights differ. On a group of ranks the same rows go through the base
sharded by FSDP2, each rank running its share of every call
(``workers.trainer.sharded_batching``).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor

from treadle.common.engine.domain import ForwardBackwardOp, ForwardLogprobsOp, ForwardResult
from treadle.errors import InternalError, TreadleError
from treadle.workers.device import device
from treadle.workers.model.llama import forward_hidden, lm_logits
from treadle.workers.model.lora import LoraAdapter, LoraRows
from treadle.workers.model.params import LlamaParams
from treadle.workers.trainer import trainer
from treadle.workers.trainer.trainer import TrainingModel

log = logging.getLogger("treadle.batching")

BatchableOp: TypeAlias = ForwardBackwardOp | ForwardLogprobsOp


def batchable(model: TrainingModel, op: object) -> bool:
    """Whether ``op`` of ``model`` may join a cross-model batch."""
    if isinstance(op, ForwardLogprobsOp) and op.reference_weights is not None:
        return False  # its own weights: a pass of its own (``workers.trainer.reference``)
    return model.adapter is not None and isinstance(op, ForwardBackwardOp | ForwardLogprobsOp)


def batch_key(model: TrainingModel) -> tuple[int, torch.dtype]:
    """Calls batch together when their models share these (the base weights object)."""
    return id(model.params), model.base.dtype


@dataclass
class BatchCall:
    """One call in a batch; ``outcome`` is set by ``run_batch`` (a result or an error)."""

    model: TrainingModel
    op: BatchableOp
    outcome: ForwardResult | Exception | None = None


@dataclass
class Rows:
    """One call's rows in a pass: ``[start, stop)`` of the padded batch (``stack_rows``)."""

    call: BatchCall
    tokens_B_T: Tensor
    targets_B_T: Tensor
    adapter: LoraAdapter | None
    temperature: float
    start: int = 0
    stop: int = 0


def run_batch(calls: Sequence[BatchCall], check: Callable[[BatchableOp], None]) -> None:
    """Run ``calls`` (all ``batchable``, all of one ``batch_key``) and set each outcome.

    ``check`` is the engine's per-call admission check (e.g. the token limit);
    it raises for a call that must fail alone.
    """
    fb: list[tuple[BatchCall, trainer.PreparedForwardBackward]] = []
    fl: list[tuple[BatchCall, trainer.TrainBatch]] = []
    for call in calls:
        try:
            check(call.op)
            if isinstance(call.op, ForwardBackwardOp):
                fb.append((call, trainer.prepare_forward_backward(call.model, call.op)))
            else:
                fl.append((call, trainer.prepare_forward_logprobs(call.model, call.op)))
        except TreadleError as err:
            call.outcome = err
    if not fb and not fl:
        return
    try:
        _run(fb, fl)
    except torch.OutOfMemoryError as err:
        # Like a bug below, no gradient was added; the pass's tensors are freed.
        oom = device.out_of_memory("batched training pass", err, calls[0].model.params.device)
        for call in [c for c, _ in fb] + [c for c, _ in fl]:
            call.outcome = oom
    except Exception as err:  # a bug, not a user error: fail this batch, keep the engine
        log.error("batched pass failed: %s\n%s", err, traceback.format_exc())
        # No gradient was added (they are added all at once, last): every model
        # keeps what its earlier calls accumulated.
        for call in [c for c, _ in fb] + [c for c, _ in fl]:
            call.outcome = InternalError(f"{call.op.kind} failed: {type(err).__name__}: {err}")


def _run(
    fb: list[tuple[BatchCall, trainer.PreparedForwardBackward]],
    fl: list[tuple[BatchCall, trainer.TrainBatch]],
) -> None:
    # Pass 1, no gradients: ForwardLogprobs rows, and reference rows of KL losses.
    no_grad_rows: list[Rows] = []
    for call, batch in fl:
        op = call.op
        assert isinstance(op, ForwardLogprobsOp)
        adapter = None if op.reference else call.model.adapter
        no_grad_rows.append(
            Rows(call, batch.tokens_B_T, batch.targets_B_T, adapter, op.temperature)
        )
    refs: list[tuple[Rows, BatchCall, trainer.PreparedForwardBackward]] = []
    for call, prep in fb:
        if prep.needs_reference:
            rows = Rows(call, prep.batch.tokens_B_T, prep.batch.targets_B_T, None, _temp(call))
            refs.append((rows, call, prep))
            no_grad_rows.append(rows)
    if no_grad_rows:
        with torch.no_grad():
            lps = _logprobs(no_grad_rows, with_entropy=False)
        for (call, batch), (lp_B_T, _) in zip(fl, lps[: len(fl)], strict=True):
            call.outcome = trainer.logprobs_result(call.model, batch, lp_B_T)
        for (_, call, prep), (lp_B_T, _) in zip(refs, lps[len(fl) :], strict=True):
            trainer.set_reference(call.model, prep, lp_B_T)
    if not fb:
        return

    # Pass 2, with gradients: every ForwardBackward row with its own adapter.
    grad_rows = [
        Rows(call, p.batch.tokens_B_T, p.batch.targets_B_T, call.model.adapter, _temp(call))
        for call, p in fb
    ]
    lps = _logprobs(grad_rows, with_entropy=True)
    total: Tensor | None = None
    for (call, prep), (lp_B_T, entropy_B_T) in zip(fb, lps, strict=True):
        op = call.op
        assert isinstance(op, ForwardBackwardOp)
        try:
            loss, result = trainer.finish_forward_backward(
                call.model, op, prep, lp_B_T, entropy_B_T
            )
        except TreadleError as err:
            call.outcome = err  # its loss stays out of the sum: no gradient from it
            continue
        total = loss if total is None else total + loss
        call.outcome = result
    if total is not None:
        trainer.accumulate_gradients(total, [call.model for call, _ in fb])


def _temp(call: BatchCall) -> float:
    return call.op.temperature


def _logprobs(rows: list[Rows], *, with_entropy: bool) -> list[tuple[Tensor, Tensor | None]]:
    """One forward over every call's rows; each call's logprobs at its own temperature."""
    tokens_B_T, lora = stack_rows(rows)
    model = rows[0].call.model
    hidden_B_T_H = forward_hidden(model.cfg, model.params, tokens_B_T, lora=lora)
    return logprobs_of_rows(rows, hidden_B_T_H, model.params, with_entropy=with_entropy)


def stack_rows(rows: list[Rows]) -> tuple[Tensor, LoraRows | None]:
    """Every call's rows in one right-padded batch (each ``Rows`` told where its rows
    are), and the adapter of each row (None: the base alone for every row)."""
    T = max(r.tokens_B_T.shape[1] for r in rows)
    start = 0
    tokens: list[Tensor] = []
    adapters: list[LoraAdapter] = []
    row_ids: list[int] = []
    for r in rows:
        B, t = r.tokens_B_T.shape
        r.start, r.stop = start, start + B
        start += B
        tokens.append(F.pad(r.tokens_B_T, (0, T - t)))  # right padding: never attended
        if r.adapter is None:
            row_ids += [-1] * B
            continue
        if all(r.adapter is not a for a in adapters):
            adapters.append(r.adapter)
        row_ids += [next(i for i, a in enumerate(adapters) if a is r.adapter)] * B
    lora = LoraRows(adapters, torch.tensor(row_ids)) if adapters else None
    return torch.cat(tokens), lora


def logprobs_of_rows(
    rows: list[Rows], hidden_B_T_H: Tensor, params: LlamaParams, *, with_entropy: bool
) -> list[tuple[Tensor, Tensor | None]]:
    """Each call's target logprobs (and entropy) from the pass's final hidden states,
    through ``params``' head with the call's own adapter, at its own temperature."""
    cfg = rows[0].call.model.cfg
    out = []
    for r in rows:
        t = r.tokens_B_T.shape[1]
        hidden = hidden_B_T_H[r.start : r.stop, :t]
        logits = lm_logits(cfg, params, hidden, lora=r.adapter)  # the call's head
        out.append(
            trainer.logprobs_from_logits(
                logits, r.targets_B_T, r.temperature, with_entropy=with_entropy
            )
        )
    return out
