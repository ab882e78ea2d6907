"""LoRA adapters over the shared base weights, one per row if need be.

A worker holds one frozen base ``LlamaParams`` and many tenants' adapters.
``forward_hidden(..., lora=...)`` takes either one ``LoraAdapter`` for the
whole batch (the fast path: two thin matmuls per projection) or a ``LoraRows``
that maps each row to its own adapter, so one forward serves a batch mixing
tenants: the base matmul runs once for all rows, then each adapter's
low-rank update is added to its rows only.

Which modules get an adapter follows the tinker SDK's three switches
(``targets_for``): attention (q/k/v/o), MLP (gate/up/down) and the
unembedding (``lm_head``). The unembedding matters most on a model whose head
is not pretrained (the random-weight presets): behind the final RMSNorm the
hidden state has a fixed norm, so with a frozen head of init scale 0.02 the
logits cannot grow past a few units and supervised loss stalls near 2
nats/token however the layers move (docs/lora.md). The head's adapter sits
after the last layer: it is "layer" ``HEAD`` (-1) of ``a``/``b``.

Conventions follow PEFT so adapters export as-is: ``A`` is ``[r, in]``
(kaiming-uniform at init), ``B`` is ``[out, r]`` (zeros at init, so a fresh
adapter computes exactly the base model), the update is ``scale * B @ A`` with
``scale = alpha / r``, and tensor names are PEFT's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from treadle.common.engine.model_config import ModelConfig
from treadle.errors import InvalidArgumentError
from treadle.workers.device.device import upload
from treadle.workers.model.llama import LlamaParams
from treadle.workers.model.low_rank import RowSelection, low_rank_add, low_rank_add_rows
from treadle.workers.model.params import TensorSet, projection_shapes

ATTN_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGET = "lm_head"
#: Every module LoRA can target, in the order adapters are initialised.
TARGETS: tuple[str, ...] = (*ATTN_TARGETS, *MLP_TARGETS, UNEMBED_TARGET)
#: What adapters targeted before the unembedding could be (checkpoints without a list).
LEGACY_TARGETS: tuple[str, ...] = (*ATTN_TARGETS, *MLP_TARGETS)
#: The ``layer`` index of the unembedding's adapter (the entry after the last layer).
HEAD = -1
_MODULE = {t: "self_attn" if t in ATTN_TARGETS else "mlp" for t in (*ATTN_TARGETS, *MLP_TARGETS)}
_PEFT_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)"
    r"\.lora_([AB])(?:\.default)?\.weight$"
)
_PEFT_HEAD_NAME = re.compile(r"^base_model\.model\.lm_head\.lora_([AB])(?:\.default)?\.weight$")


def targets_for(*, train_attn: bool, train_mlp: bool, train_unembed: bool) -> tuple[str, ...]:
    """The modules the tinker SDK's ``train_attn``/``train_mlp``/``train_unembed`` name."""
    if not (train_attn or train_mlp or train_unembed):
        raise InvalidArgumentError(
            "train_attn, train_mlp, train_unembed: at least one must be true for a LoRA model"
        )
    return (
        (ATTN_TARGETS if train_attn else ())
        + (MLP_TARGETS if train_mlp else ())
        + ((UNEMBED_TARGET,) if train_unembed else ())
    )


def projection_shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(out_features, in_features) of a base projection."""
    if target == "lm_head":
        return (cfg.vocab_size, cfg.hidden_size)
    return projection_shapes(cfg)[target]


def peft_name(layer: int, target: str, which: str) -> str:
    """PEFT's saved name of ``lora_A``/``lora_B`` (``which`` = "A"/"B")."""
    if target == UNEMBED_TARGET:
        return f"base_model.model.lm_head.lora_{which}.weight"
    return f"base_model.model.model.layers.{layer}.{_MODULE[target]}.{target}.lora_{which}.weight"


def _layers(cfg: ModelConfig) -> list[int]:
    """Indices into ``a``/``b``: every decoder layer, then the unembedding (``HEAD``)."""
    return [*range(cfg.num_layers), HEAD]


def _in_layer(layer: int, target: str) -> bool:
    return (target == UNEMBED_TARGET) == (layer == HEAD)


class LoraAdapter(TensorSet):
    """One adapter: ``A`` ``[r, in]`` and ``B`` ``[out, r]`` per (layer, target module).

    ``a``/``b`` hold ``num_layers + 1`` dicts: one per decoder layer, then the
    unembedding's (index ``HEAD`` = -1, empty unless ``lm_head`` is targeted)."""

    def __init__(
        self,
        cfg: ModelConfig,
        rank: int,
        alpha: float,
        *,
        seed: int = 0,
        targets: Sequence[str] = TARGETS,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        requires_grad: bool = True,
    ) -> None:
        """A fresh adapter, deterministic in ``seed``, equal to the base model.

        ``A`` is drawn like PEFT's ``kaiming_uniform_(a=sqrt(5))``, i.e.
        uniform in ``±1/sqrt(in)``, layer by layer in ``TARGETS`` order from a
        private generator (the global RNG is untouched).
        """
        if rank <= 0:
            raise InvalidArgumentError(f"rank: must be positive, got {rank}")
        unknown = [t for t in targets if t not in TARGETS]
        if unknown or not targets:
            raise InvalidArgumentError(f"targets: {unknown or 'empty'} (choose from {TARGETS})")
        self.cfg = cfg
        self.rank = rank
        self.alpha = float(alpha)
        self.scale = self.alpha / rank
        self.targets = tuple(t for t in TARGETS if t in targets)
        gen = torch.Generator().manual_seed(seed)
        self.a: list[dict[str, Tensor]] = []
        self.b: list[dict[str, Tensor]] = []
        for n in _layers(cfg):
            a_layer, b_layer = {}, {}
            for t in self.targets:
                if not _in_layer(n, t):
                    continue
                out_f, in_f = projection_shape(cfg, t)
                bound = 1.0 / math.sqrt(in_f)
                a = torch.empty(rank, in_f, dtype=torch.float32).uniform_(
                    -bound, bound, generator=gen
                )
                a_layer[t] = a.to(dtype=dtype, device=device)
                b_layer[t] = torch.zeros(out_f, rank, dtype=dtype, device=device)
            self.a.append(a_layer)
            self.b.append(b_layer)
        self.requires_grad_(requires_grad)

    # ------------------------------------------------------------------ tensors

    def named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """(PEFT name, tensor) for every A and B."""
        for n in _layers(self.cfg):
            for t in self.a[n]:
                yield peft_name(n, t, "A"), self.a[n][t]
                yield peft_name(n, t, "B"), self.b[n][t]

    def clone(self) -> LoraAdapter:
        """An independent, detached copy (e.g. a published weight version)."""
        return LoraAdapter.from_named_tensors(
            self.cfg,
            {k: v.detach().clone() for k, v in self.named_tensors()},
            alpha=self.alpha,
            requires_grad=False,
        )

    def peft_config(self) -> dict[str, Any]:
        """The ``adapter_config.json`` PEFT expects next to the tensors."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": list(self.targets),
        }

    @classmethod
    def from_named_tensors(
        cls,
        cfg: ModelConfig,
        tensors: Mapping[str, Tensor],
        *,
        alpha: float,
        requires_grad: bool = False,
    ) -> LoraAdapter:
        """Rebuild an adapter from PEFT-named tensors (takes them as they are, no copy).

        Rank and targets are read from the tensors; every layer must carry the
        same targets with consistent shapes.
        """
        found: dict[tuple[int, str, str], Tensor] = {}
        for name, tensor in tensors.items():
            m = _PEFT_NAME.match(name)
            head = _PEFT_HEAD_NAME.match(name)
            if head is not None:
                found[(HEAD, UNEMBED_TARGET, head.group(1))] = tensor
            elif m is None or m.group(2) not in TARGETS:
                raise InvalidArgumentError(f"lora tensors: unexpected name {name!r}")
            else:
                found[(int(m.group(1)), m.group(2), m.group(3))] = tensor
        targets = tuple(t for t in TARGETS if any(k[1] == t for k in found))
        if not targets:
            raise InvalidArgumentError("lora tensors: none found")
        first_layer = HEAD if targets[0] == UNEMBED_TARGET else 0
        first = found.get((first_layer, targets[0], "A"))
        if first is None:
            raise InvalidArgumentError(
                f"lora tensors: missing {peft_name(first_layer, targets[0], 'A')}"
            )
        rank = first.shape[0]
        self = cls.__new__(cls)
        self.cfg, self.rank, self.alpha = cfg, rank, float(alpha)
        self.scale, self.targets = self.alpha / rank, targets
        self.a, self.b = [], []
        for n in _layers(cfg):
            a_layer: dict[str, Tensor] = {}
            b_layer: dict[str, Tensor] = {}
            for t in targets:
                if not _in_layer(n, t):
                    continue
                out_f, in_f = projection_shape(cfg, t)
                for which, shape, into in (
                    ("A", (rank, in_f), a_layer),
                    ("B", (out_f, rank), b_layer),
                ):
                    if (n, t, which) not in found:
                        raise InvalidArgumentError(
                            f"lora tensors: missing {peft_name(n, t, which)}"
                        )
                    tensor = found.pop((n, t, which))
                    if tuple(tensor.shape) != shape:
                        raise InvalidArgumentError(
                            f"lora tensors: {peft_name(n, t, which)} has shape "
                            f"{tuple(tensor.shape)}, expected {shape}"
                        )
                    into[t] = tensor
            self.a.append(a_layer)
            self.b.append(b_layer)
        if found:
            extra = peft_name(*next(iter(found)))
            raise InvalidArgumentError(f"lora tensors: {extra} is beyond the model's layers")
        return self.requires_grad_(requires_grad)

    def merge_into(self, params: LlamaParams) -> dict[str, Tensor]:
        """HF-named weights with ``W + scale * B @ A`` folded in (for export).

        Untargeted tensors are returned as they are (shared, not copied). An
        adapted head of a tied model comes back as its own ``lm_head.weight``
        (the embedding stays as it was): the merged model is no longer tied.
        """
        return dict(self.merged(params.named_tensors(), tied=params.lm_head is None))

    @property
    def adapts_head(self) -> bool:
        return UNEMBED_TARGET in self.a[HEAD]

    def merged(
        self, named: Iterable[tuple[str, Tensor]], *, tied: bool
    ) -> Iterator[tuple[str, Tensor]]:
        """``merge_into`` one tensor at a time: each of the base's (HF name, tensor)
        as ``named`` yields them, merged where this adapter targets it; with
        ``tied`` (the base has no ``lm_head.weight``) and an adapted head, the
        merged head follows the embedding as its own ``lm_head.weight``. A base
        read one whole tensor at a time (sharded over a group) is merged so."""
        targets = {
            f"model.layers.{n}.{_MODULE[t]}.{t}.weight": (n, t)
            for n in _layers(self.cfg)
            for t in self.a[n]
            if t != UNEMBED_TARGET
        }
        head = self.adapts_head
        for name, w in named:
            if name in targets:
                yield name, self._merge(w, *targets[name])
            elif name == "lm_head.weight" and head:
                yield name, self._merge(w, HEAD, UNEMBED_TARGET)
            else:
                yield name, w
            if name == "model.embed_tokens.weight" and head and tied:
                yield "lm_head.weight", self._merge(w, HEAD, UNEMBED_TARGET)

    @torch.no_grad()
    def _merge(self, w: Tensor, layer: int, target: str) -> Tensor:
        delta = self.b[layer][target].to(torch.float32) @ self.a[layer][target].to(torch.float32)
        return (w.to(torch.float32) + self.scale * delta).to(w.dtype)

    # ------------------------------------------------------------------ forward

    def delta(self, layer: int, target: str, x: Tensor) -> Tensor | None:
        """``scale * x @ A.T @ B.T`` (unscaled product shape ``[..., out]``), or None if untargeted."""
        a = self.a[layer].get(target)
        if a is None:
            return None
        return F.linear(F.linear(x, a), self.b[layer][target]) * self.scale

    def apply(self, layer: int, target: str, x: Tensor, y: Tensor) -> Tensor:
        """``y + scale * B A x`` for every row: the single-adapter fast path.

        Two plain ``F.linear``: on one adapter's rows ``low_rank_add`` (whose
        backward runs in Python) measured no faster in a whole model's
        ``forward_backward``, so the adapter keeps the simpler form."""
        a = self.a[layer].get(target)
        if a is None:
            return y
        return y.add_(F.linear(F.linear(x, a), self.b[layer][target]), alpha=self.scale)


class LoraRows:
    """A batch where row b uses ``adapters[row_adapter_B[b]]`` (-1: base model only).

    The base output of all rows is computed once (the shared matmul); then each
    adapter's update is added to its own rows only, so one forward serves a batch
    mixing tenants. One adapter for every row is the single-adapter fast path.

    Training batches are usually tidy: each call's rows are contiguous, and calls of
    one shape give every adapter the same number of rows. Then the rows split into
    equal segments, one per adapter, and batched products apply each adapter to its
    own segment (``segments``, ``low_rank.low_rank_add``). Otherwise (calls of
    different sizes, a sampler's rows of any adapter in any order, rows of the base
    model) each adapter takes its own rows, a contiguous range or an index, through
    ``low_rank.low_rank_add_rows``.

    Both forms keep tenants apart in the numbers too: an adapter's products read
    its own rows only, forward and backward, so a NaN or inf in one tenant's adapter
    or rows (a diverged model, an overflowing loss) reaches no other row's output and
    no other adapter's gradient (``tests/unit/trainer/test_batched_walls.py``). A
    dense form that multiplied every row by every adapter and masked with zeros did
    not: NaN × 0 is NaN (docs/engine.md, "Multi-LoRA").
    """

    def __init__(
        self, adapters: Sequence[LoraAdapter], row_adapter_B: Tensor | Sequence[int]
    ) -> None:
        # the ids as host ints (a list given stays on the host: no device read)
        if isinstance(row_adapter_B, Tensor):
            ids = [int(i) for i in row_adapter_B.tolist()]
        else:
            ids = [int(i) for i in row_adapter_B]
            row_adapter_B = torch.tensor(ids, dtype=torch.long)
        bad = [i for i in ids if not -1 <= i < len(adapters)]
        if bad:
            raise InvalidArgumentError(
                f"row_adapter_B: ids {sorted(set(bad))} outside -1..{len(adapters) - 1}"
            )
        self.adapters = list(adapters)
        self.row_adapter_B = row_adapter_B
        self.row_ids = ids
        self.used = sorted(set(ids) - {-1})
        #: each used adapter and its rows: None (every row), a range, or an index
        self.groups: list[tuple[LoraAdapter, RowSelection | None]] = []
        for adapter_id in self.used:
            rows = [b for b, i in enumerate(ids) if i == adapter_id]
            if len(rows) == len(ids):
                self.groups.append((self.adapters[adapter_id], None))
            elif rows[-1] - rows[0] + 1 == len(rows):
                self.groups.append((self.adapters[adapter_id], slice(rows[0], rows[-1] + 1)))
            else:
                # on the adapter's device (the row ids may be a host tensor)
                where = _device_of(self.adapters[adapter_id])
                idx = upload(torch.tensor(rows, dtype=torch.long), where)
                self.groups.append((self.adapters[adapter_id], idx))
        self.segments = self._equal_segments(ids)

    def _equal_segments(self, ids: list[int]) -> list[int] | None:
        """Adapter ids of equal, contiguous row segments covering every row, if
        the rows split so (no base-only row; ranks may differ, ``_apply_segments``
        pads the smaller ones)."""
        runs: list[int] = []
        for b, i in enumerate(ids):
            if b == 0 or i != ids[b - 1]:
                runs.append(i)
        n = len(runs)
        if n < 2 or -1 in runs or len(ids) % n or len(set(runs)) != n:
            return None
        size = len(ids) // n
        if any(ids[k * size] != runs[k] for k in range(n)):
            return None  # runs of unequal length
        return runs

    def apply(self, layer: int, target: str, x_B_T_I: Tensor, y_B_T_O: Tensor) -> Tensor:
        if len(self.groups) == 1 and self.groups[0][1] is None:
            return self.groups[0][0].apply(layer, target, x_B_T_I, y_B_T_O)
        parts = [
            (rows, adapter.a[layer][target], adapter.b[layer][target], adapter.scale)
            for adapter, rows in self.groups
            if rows is not None and target in adapter.a[layer]
        ]
        if not parts:
            return y_B_T_O
        if self.segments is not None and len(parts) == len(self.segments):
            return self._apply_segments(layer, target, x_B_T_I, y_B_T_O)
        return low_rank_add_rows(y_B_T_O, x_B_T_I, parts)

    def _apply_segments(self, layer: int, target: str, x_B_T_I: Tensor, y_B_T_O: Tensor) -> Tensor:
        """Segment k (rows ``k*B/n`` onward) gets adapter ``segments[k]``: ``low_rank_add``."""
        assert self.segments is not None
        adapters = [self.adapters[i] for i in self.segments]
        n, out_dim = len(adapters), y_B_T_O.shape[-1]
        # Mixed ranks (a sweep of ranks 8 and 16): the smaller are padded with zero
        # rows of A and zero columns of B, which add exactly nothing to their rows
        # (each problem of the batched products is one adapter's own segment) and
        # cost far less than multiplying every row by every adapter.
        rank = max(a.a[layer][target].shape[0] for a in adapters)
        a_N_R_I = torch.stack([_pad_rank(a.a[layer][target], rank, 0) for a in adapters])
        b_N_O_R = torch.stack([_pad_rank(a.b[layer][target], rank, 1) for a in adapters])
        scales = [a.scale for a in adapters]
        scale: float | Tensor = scales[0]
        if len(set(scales)) > 1:
            scale = upload(torch.tensor(scales, dtype=y_B_T_O.dtype), y_B_T_O.device).view(n, 1, 1)
        out = low_rank_add(
            y_B_T_O.reshape(n, -1, out_dim),
            x_B_T_I.reshape(n, -1, x_B_T_I.shape[-1]),
            a_N_R_I,
            b_N_O_R,
            scale,
        )
        return out.view(y_B_T_O.shape)


def _pad_rank(t: Tensor, rank: int, dim: int) -> Tensor:
    """``t`` with zeros appended along its rank dimension ``dim`` up to ``rank``."""
    missing = rank - t.shape[dim]
    if not missing:
        return t
    return F.pad(t, (0, missing) if dim == 1 else (0, 0, 0, missing))


def _device_of(adapter: LoraAdapter) -> torch.device:
    """Where an adapter's tensors live (the CPU for one that adapts nothing)."""
    for layer in adapter.a:
        for t in layer.values():
            return t.device
    return torch.device("cpu")
