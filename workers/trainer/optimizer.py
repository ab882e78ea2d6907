"""AdamW over named tensors, written out so its formula is the documented one.

Per step t (1-based), for each trainable tensor p with gradient g:

    g      <- g * min(1, grad_clip_norm / (||g_all||_2 + 1e-6))   (if grad_clip_norm > 0)
    m      <- beta1 * m + (1 - beta1) * g
    v      <- beta2 * v + (1 - beta2) * g^2
    p      <- p - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
                - lr * weight_decay * p                            (decoupled decay)

Hyper-parameters arrive with every ``OptimStep`` (a schedule lives on the client),
so the state is only (m, v, t). Kept by name so checkpoints are plain safetensors.

A step with no gradient (no ``ForwardBackward`` since the last step, or only
zero gradients) still moves the weights: ``m`` carries the earlier gradients.
That is the formula, kept; the step reports it as ``no_grad:value`` = 1, and
the SDK warns, so it is never silent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch.autograd.graph import increment_version
from torch.profiler import record_function

from treadle.common.engine.domain import AdamConfig

#: tensors of one fused call: their size bounds the update-norm temporaries (the
#: one largest tensor, an embedding, may exceed it alone)
_CHUNK_BYTES = 64 * 2**20


class AdamW:
    """The formula above, run by torch's fused AdamW kernel (``torch._fused_adamw_``).

    The fused kernel computes exactly the documented update (decoupled decay on
    the pre-step weights, bias-corrected moments) in one pass over weights,
    gradient and moments, where the written-out form took about fifteen.
    ``update_norm`` is the realised move ``||p_after - p_before||``: each chunk
    of tensors is copied before its update and compared after, so the metric
    costs one copy of a chunk, never a pass over every weight at once.
    """

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.params = dict(params)
        self.step_count = 0
        #: the weights may differ from those given: a step was applied or a state loaded
        #: (``TrainingModel.snapshot`` shares the base weights until then)
        self.weights_moved = False
        self.exp_avg = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in self.params.items()}
        #: sums a float64 scalar over a group of ranks when the tensors are shards of a
        #: sharded model (``workers.trainer.fsdp``): the norms are the whole model's
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    @torch.no_grad()
    def grad_norm(self) -> float:
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        return _global_norm(grads, self.reduce)

    @torch.no_grad()
    def step(self, cfg: AdamConfig) -> dict[str, float]:
        """Apply one update from the accumulated gradients, then zero them."""
        names = list(self.params)
        # the fused kernel reads every tensor as dense: a strided gradient would be misread
        grads = [
            p.grad.contiguous() if p.grad is not None else torch.zeros_like(p)
            for p in self.params.values()
        ]
        chunks = _chunks([self.params[n] for n in names])
        # Every large allocation of the step happens here, before anything changes:
        # out of memory (a full GPU) then leaves weights, moments, gradients and the
        # step count as they were, and the model at its last applied step.
        scratch = _scratch([[self.params[names[i]] for i in idx] for idx in chunks])
        with record_function("treadle.grad_norm"):  # named: benchmarks/train_step.py --profile
            pre_clip = _global_norm(grads, self.reduce)
        if cfg.grad_clip_norm > 0:
            scale = min(1.0, cfg.grad_clip_norm / (pre_clip + 1e-6))
            if scale != 1.0:
                torch._foreach_mul_(grads, scale)  # the accumulated gradients are consumed
        self.step_count += 1
        self.weights_moved = True
        update_sq_t = torch.zeros((), dtype=torch.float64)
        for idx in chunks:
            ps = [self.params[names[i]].detach() for i in idx]
            with record_function("treadle.update_norm"):
                before = _copies(ps, scratch)
            # the kernel reads the step on the weights' device (a host scalar on the CPU)
            step_t = torch.tensor(float(self.step_count), dtype=torch.float32, device=ps[0].device)
            with record_function("treadle.adamw"):
                torch._fused_adamw_(
                    ps,
                    [grads[i] for i in idx],
                    [self.exp_avg[names[i]] for i in idx],
                    [self.exp_avg_sq[names[i]] for i in idx],
                    [],
                    [step_t] * len(idx),
                    lr=cfg.learning_rate,
                    beta1=cfg.beta1,
                    beta2=cfg.beta2,
                    weight_decay=cfg.weight_decay,
                    eps=cfg.eps,
                    amsgrad=False,
                    maximize=False,
                )
            # the fused kernel does not bump the tensors' version counters as in-place
            # ops do; caches keyed on them (``model.prepack``) must see the change
            increment_version(ps)
            # summed on the device: one host read per step, not one per tensor
            with record_function("treadle.update_norm"):
                # the copies are ours: the move is taken in place, no new tensor per weight
                torch._foreach_sub_(before, ps)
                moved = torch.stack(torch._foreach_norm(before))
                update_sq_t = update_sq_t + (moved.double() ** 2).sum()
            del before
        self.zero_grad()
        if self.reduce is not None:
            update_sq_t = self.reduce(update_sq_t)
        return {
            "grad_norm:value": pre_clip,
            "update_norm:value": math.sqrt(float(update_sq_t)),
            "learning_rate:value": cfg.learning_rate,
            "step:value": float(self.step_count),
            # 1: nothing to learn from (no gradient, or all zero), yet the momentum moved the weights
            "no_grad:value": 1.0 if pre_clip == 0.0 else 0.0,
        }

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name in self.params:
            out[f"exp_avg.{name}"] = self.exp_avg[name]
            out[f"exp_avg_sq.{name}"] = self.exp_avg_sq[name]
        return out

    @torch.no_grad()
    def reset_moments(self) -> None:
        """Fresh Adam state (zero moments, step 0) under weights that were just replaced."""
        for name, p in self.params.items():
            self.exp_avg[name] = torch.zeros_like(p)
            self.exp_avg_sq[name] = torch.zeros_like(p)
        self.step_count = 0
        self.weights_moved = True

    @torch.no_grad()
    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor], step_count: int) -> None:
        for name, p in self.params.items():
            self.exp_avg[name] = (
                tensors[f"exp_avg.{name}"].to(dtype=p.dtype, device=p.device).clone()
            )
            self.exp_avg_sq[name] = (
                tensors[f"exp_avg_sq.{name}"].to(dtype=p.dtype, device=p.device).clone()
            )
        self.step_count = step_count
        self.weights_moved = True  # checkpoint.load_state replaces the weights with it


def _global_norm(
    tensors: list[torch.Tensor],
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """``sqrt(sum ||t||^2)``: one read of each tensor (``_foreach_norm``), summed in
    float64 (and over the group's ranks with ``reduce``: every rank calls it)."""
    if tensors:
        norms = torch.stack(torch._foreach_norm(tensors)).double()
        sq = (norms * norms).sum()
    else:
        sq = torch.zeros((), dtype=torch.float64)
    if reduce is not None:
        sq = reduce(sq)
    return math.sqrt(float(sq))


def _scratch(chunks: list[list[torch.Tensor]]) -> torch.Tensor | None:
    """One buffer that holds the largest chunk's copies (None: mixed dtypes or
    devices, each chunk is cloned as it comes)."""
    flat = [p for chunk in chunks for p in chunk]
    if not flat or len({(p.dtype, p.device) for p in flat}) != 1:
        return None
    size = max(sum(p.numel() for p in chunk) for chunk in chunks)
    return torch.empty(size, dtype=flat[0].dtype, device=flat[0].device)


def _copies(ps: list[torch.Tensor], scratch: torch.Tensor | None) -> list[torch.Tensor]:
    """Copies of ``ps`` (the weights before a chunk's update), in ``scratch`` when given."""
    if scratch is None:
        return [p.clone() for p in ps]
    out, at = [], 0
    for p in ps:
        out.append(scratch[at : at + p.numel()].view_as(p))
        at += p.numel()
    torch._foreach_copy_(out, ps)
    return out


def _chunks(params: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``params`` in runs of at most ``_CHUNK_BYTES`` (at least one tensor each)."""
    out: list[list[int]] = []
    size = 0
    for i, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > _CHUNK_BYTES:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out
