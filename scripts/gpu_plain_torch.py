"""The GPU check's plain-torch LoRA: what ``scripts/gpu_check.py`` times the engine's
LoRA training step against (no PEFT on a bare GPU host)."""

from __future__ import annotations

import torch


def add_lora(model: torch.nn.Module, rank: int) -> list[torch.Tensor]:
    """Plain-torch LoRA (``W x + alpha/r B A x``, alpha = r) on every projection of
    the decoder layers; the base frozen. The trainable tensors."""
    for p in model.parameters():
        p.requires_grad_(False)
    trainable: list[torch.Tensor] = []
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, torch.nn.Linear):
                lora = LoraLinear(child, rank)
                setattr(module, child_name, lora)
                trainable += [lora.a, lora.b]
    return trainable


class LoraLinear(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        w = base.weight
        self.a = torch.nn.Parameter(
            torch.randn(rank, w.shape[1], dtype=w.dtype, device=w.device) * 0.01
        )
        self.b = torch.nn.Parameter(torch.zeros(w.shape[0], rank, dtype=w.dtype, device=w.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()
