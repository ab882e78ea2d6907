"""Cross-model training batches: several LoRA models' calls in one pass.

Every LoRA model of a worker shares the frozen base weights, so the
``ForwardBackward`` and ``ForwardLogprobs`` calls of different models (up to
each model's next barrier, as the scheduler hands them out) can run as one
forward: the base matmuls once for every row, each row's low-rank update from
its own adapter (``LoraSegments``). Each call keeps its own loss, computed on
its own rows only, so the one ``backward()`` of the summed losses gives every
adapter exactly the gradient of its own call(s): the same numbers, within
floating-point reordering, as running each call alone (``trainer``).

Each call is validated on its own first (``trainer.prepare_*``): a bad call
fails alone and never enters the batch. A call whose loss fails after the
forward is dropped from the sum, which leaves no gradient behind.

Two passes at most: one without gradients (``ForwardLogprobs`` rows, and the
reference rows of losses with a KL penalty, base weights only) and one with
(``ForwardBackward`` rows). Full fine-tunes are never batched across models:
their base weights differ.
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

from treadle.errors import InternalError, TreadleError
from treadle.workers import trainer
from treadle.workers.domain import ForwardBackwardOp, ForwardLogprobsOp, ForwardResult
from treadle.workers.model.llama import forward_hidden, lm_logits
from treadle.workers.model.lora import LoraAdapter
from treadle.workers.trainer import TrainingModel

log = logging.getLogger("treadle.batching")

BatchableOp: TypeAlias = ForwardBackwardOp | ForwardLogprobsOp


def batchable(model: TrainingModel, op: object) -> bool:
    """Whether ``op`` of ``model`` may join a cross-model batch."""
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


class LoraSegments:
    """Rows ``[start, stop)`` use ``adapter`` (None: the base model only).

    The batch is laid out call by call, so each adapter's rows are one
    contiguous range. When every segment has an adapter of one rank and the
    segments are the same size (calls of one shape, the common case), all
    updates run as two batched matmuls over the stacked adapters (BGMV-style:
    a handful of ops whatever the number of tenants). Otherwise each adapter's
    update is computed on a view of ``x`` (no gather), and all are
    concatenated and added in one op (no scatter).
    """

    def __init__(self, segments: Sequence[tuple[int, int, LoraAdapter | None]]) -> None:
        self.segments = list(segments)
        sizes = {stop - start for start, stop, _ in self.segments}
        adapters = [a for _, _, a in self.segments]
        self.stacked: list[LoraAdapter] | None = None
        if len(self.segments) > 1 and len(sizes) == 1 and all(a is not None for a in adapters):
            ranks = {a.rank for a in adapters if a is not None}
            if len(ranks) == 1:
                self.stacked = [a for a in adapters if a is not None]

    def apply(self, layer: int, target: str, x_B_T_I: Tensor, y_B_T_O: Tensor) -> Tensor:
        if len(self.segments) == 1 and self.segments[0][2] is not None:
            return self.segments[0][2].apply(layer, target, x_B_T_I, y_B_T_O)
        if self.stacked is not None and all(target in a.a[layer] for a in self.stacked):
            return self._apply_stacked(self.stacked, layer, target, x_B_T_I, y_B_T_O)
        parts: list[Tensor] = []
        any_update = False
        for start, stop, adapter in self.segments:
            delta = None if adapter is None else adapter.delta(layer, target, x_B_T_I[start:stop])
            if delta is None:
                parts.append(y_B_T_O.new_zeros((stop - start, *y_B_T_O.shape[1:])))
            else:
                parts.append(delta)
                any_update = True
        if not any_update:
            return y_B_T_O
        return y_B_T_O + torch.cat(parts)

    @staticmethod
    def _apply_stacked(
        adapters: list[LoraAdapter], layer: int, target: str, x_B_T_I: Tensor, y_B_T_O: Tensor
    ) -> Tensor:
        n = len(adapters)
        a_N_R_I = torch.stack([a.a[layer][target] for a in adapters])
        b_N_O_R = torch.stack([a.b[layer][target] for a in adapters])
        scales = [a.scale for a in adapters]
        alpha = scales[0]
        if len(set(scales)) > 1:  # fold each adapter's scale into its (small) B
            scale_N = torch.tensor(scales, dtype=b_N_O_R.dtype, device=b_N_O_R.device)
            b_N_O_R, alpha = b_N_O_R * scale_N[:, None, None], 1.0
        x_N_M_I = x_B_T_I.reshape(n, -1, x_B_T_I.shape[-1])
        h_N_M_R = torch.bmm(x_N_M_I, a_N_R_I.transpose(1, 2))
        y_N_M_O = y_B_T_O.reshape(n, -1, y_B_T_O.shape[-1])
        out_N_M_O = torch.baddbmm(y_N_M_O, h_N_M_R, b_N_O_R.transpose(1, 2), alpha=alpha)
        return out_N_M_O.reshape(y_B_T_O.shape)


@dataclass
class _Rows:
    """One call's rows in a pass: ``[start, stop)`` of the padded batch."""

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
    except Exception as err:  # a bug, not a user error: fail this batch, keep the engine
        log.error("batched pass failed: %s\n%s", err, traceback.format_exc())
        for call, _ in fb:
            call.model.optimizer.zero_grad()  # a half-done backward must not leak
        for call in [c for c, _ in fb] + [c for c, _ in fl]:
            call.outcome = InternalError(f"{call.op.kind} failed: {type(err).__name__}: {err}")


def _run(
    fb: list[tuple[BatchCall, trainer.PreparedForwardBackward]],
    fl: list[tuple[BatchCall, trainer.TrainBatch]],
) -> None:
    # Pass 1, no gradients: ForwardLogprobs rows, and reference rows of KL losses.
    no_grad_rows: list[_Rows] = []
    for call, batch in fl:
        op = call.op
        assert isinstance(op, ForwardLogprobsOp)
        adapter = None if op.reference else call.model.adapter
        no_grad_rows.append(
            _Rows(call, batch.tokens_B_T, batch.targets_B_T, adapter, op.temperature)
        )
    refs: list[tuple[_Rows, BatchCall, trainer.PreparedForwardBackward]] = []
    for call, prep in fb:
        if prep.needs_reference:
            rows = _Rows(call, prep.batch.tokens_B_T, prep.batch.targets_B_T, None, _temp(call))
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
        _Rows(call, p.batch.tokens_B_T, p.batch.targets_B_T, call.model.adapter, _temp(call))
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
        total.backward()


def _temp(call: BatchCall) -> float:
    return call.op.temperature


def _logprobs(rows: list[_Rows], *, with_entropy: bool) -> list[tuple[Tensor, Tensor | None]]:
    """One forward over every call's rows; each call's logprobs at its own temperature."""
    T = max(r.tokens_B_T.shape[1] for r in rows)
    start = 0
    tokens, segments = [], []
    for r in rows:
        B, t = r.tokens_B_T.shape
        r.start, r.stop = start, start + B
        start += B
        tokens.append(F.pad(r.tokens_B_T, (0, T - t)))  # right padding: never attended
        segments.append((r.start, r.stop, r.adapter))
    model = rows[0].call.model
    tokens_B_T = torch.cat(tokens)
    hidden_B_T_H = forward_hidden(
        model.cfg, model.params, tokens_B_T, lora=LoraSegments(_merge(segments))
    )
    out = []
    for r in rows:
        t = r.tokens_B_T.shape[1]
        logits = lm_logits(model.cfg, model.params, hidden_B_T_H[r.start : r.stop, :t])
        out.append(
            trainer.logprobs_from_logits(
                logits, r.targets_B_T, r.temperature, with_entropy=with_entropy
            )
        )
    return out


def _merge(
    segments: list[tuple[int, int, LoraAdapter | None]],
) -> list[tuple[int, int, LoraAdapter | None]]:
    """Join neighbouring segments of the same adapter (a model's several calls)."""
    merged: list[tuple[int, int, LoraAdapter | None]] = []
    for start, stop, adapter in segments:
        if merged and merged[-1][2] is adapter and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop, adapter)
        else:
            merged.append((start, stop, adapter))
    return merged
