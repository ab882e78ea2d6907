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
from collections.abc import Mapping

import torch

from treadle.workers.domain import AdamConfig


class AdamW:
    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.params = dict(params)
        self.step_count = 0
        self.exp_avg = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in self.params.items()}

    @torch.no_grad()
    def grad_norm(self) -> float:
        sq = [p.grad.pow(2).sum() for p in self.params.values() if p.grad is not None]
        return math.sqrt(float(torch.stack(sq).sum())) if sq else 0.0

    @torch.no_grad()
    def step(self, cfg: AdamConfig) -> dict[str, float]:
        """Apply one update from the accumulated gradients, then zero them."""
        pre_clip = self.grad_norm()
        scale = 1.0
        if cfg.grad_clip_norm > 0:
            scale = min(1.0, cfg.grad_clip_norm / (pre_clip + 1e-6))
        self.step_count += 1
        t = self.step_count
        bc1 = 1.0 - cfg.beta1**t
        bc2 = 1.0 - cfg.beta2**t
        update_sq = 0.0
        for name, p in self.params.items():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if scale != 1.0:
                g = g * scale
            m = self.exp_avg[name]
            v = self.exp_avg_sq[name]
            m.mul_(cfg.beta1).add_(g, alpha=1.0 - cfg.beta1)
            v.mul_(cfg.beta2).addcmul_(g, g, value=1.0 - cfg.beta2)
            denom = (v / bc2).sqrt_().add_(cfg.eps)
            delta = (m / bc1).div_(denom).mul_(-cfg.learning_rate)
            if cfg.weight_decay:
                delta.add_(p, alpha=-cfg.learning_rate * cfg.weight_decay)
            p.add_(delta)
            update_sq += float(delta.pow(2).sum())
            p.grad = None
        return {
            "grad_norm:value": pre_clip,
            "update_norm:value": math.sqrt(update_sq),
            "learning_rate:value": cfg.learning_rate,
            "step:value": float(t),
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
    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor], step_count: int) -> None:
        for name, p in self.params.items():
            self.exp_avg[name] = tensors[f"exp_avg.{name}"].to(dtype=p.dtype).clone()
            self.exp_avg_sq[name] = tensors[f"exp_avg_sq.{name}"].to(dtype=p.dtype).clone()
        self.step_count = step_count
