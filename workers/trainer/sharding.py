"""A full fine-tune sharded over a group of ranks (``--ranks N``): each rank keeps
1/N of every trainable tensor, of its gradient and of its two AdamW moments
(ZeRO-3 / FSDP's "full shard", on torch.distributed's collectives).

A tensor's shard is a flat slice: the tensor flattened, padded with zeros to a
multiple of N, rank r's N-th part. Between calls a rank holds only its shards
(``TrainingModel.params`` then holds flat shards, never run by a forward).

A ``ForwardBackward`` (``forward_backward``) runs layer by layer, as FSDP does:
each layer's weights all-gathered, run on the rank's share of the datums, and
freed; gathered again in the backward, the layer recomputed, its gradient
reduce-scattered into the shards' (the sum over ranks, as the data-parallel
step's). AdamW steps each rank's shards (the update is elementwise; the
padding stays zero), with the clip and update norms summed over the group, so
every rank's shard moves as the same slice of a one-rank model would. A call
that reads the whole weights on rank 0 (``whole``: ``forward_logprobs``, a
published version, a checkpoint, an export) gathers them there for its duration
(``dist.gather``: the other ranks send their shards, ``send_whole``).

Every function here is a collective: each rank calls it in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields, replace
from functools import partial
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import record_function

from treadle.common.engine.domain import ForwardBackwardOp, ForwardResult
from treadle.common.engine.model_config import ModelConfig
from treadle.workers.model.llama import decoder_layer, rms_norm, rope_cos_sin
from treadle.workers.model.params import LayerParams, LlamaParams, layer_tensor_name
from treadle.workers.trainer import trainer
from treadle.workers.trainer.trainer import PreparedForwardBackward, Sharding, TrainingModel

_R = TypeVar("_R")


class FlatShards(Sharding):
    """Flat, zero-padded 1/N slices over the default process group."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], element_size: int) -> None:
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        #: each tensor's whole shape, by name
        self.shapes = shapes
        sizes: dict[str, int] = {}  # elements: of each layer ("model.layers.<n>"), or tensor
        for name, shape in shapes.items():
            key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
            sizes[key] = sizes.get(key, 0) + math.prod(shape)
        layer = max((v for k, v in sizes.items() if k.startswith("model.layers.")), default=0)
        others = sum(v for k, v in sizes.items() if not k.startswith("model.layers."))
        self.gathered_bytes = (others + layer) * element_size

    @classmethod
    def of(cls, model: TrainingModel) -> FlatShards:
        shapes = {n: tuple(t.shape) for n, t in model.params.named_tensors()}
        return cls(shapes, model.params.embed_tokens.element_size())

    def take(self, full: Tensor) -> Tensor:
        """This rank's slice of ``full`` (a copy: the whole tensor can be freed)."""
        chunk = -(-full.numel() // self.size)
        flat = full.detach().reshape(-1)[self.rank * chunk : (self.rank + 1) * chunk]
        out = full.new_zeros(chunk)
        out[: flat.numel()] = flat
        return out

    def gather(self, name: str, shard: Tensor) -> Tensor:
        """The whole tensor ``name`` from every rank's ``shard``."""
        whole = shard.new_empty(shard.numel() * self.size)
        dist.all_gather_single(whole, shard.detach())
        shape = self.shapes[name]
        return whole[: math.prod(shape)].view(shape)

    def gather_to_root(self, name: str, shard: Tensor) -> Tensor | None:
        """The whole tensor ``name`` on rank 0 (None on the others, which only send)."""
        if self.rank != 0:
            dist.gather(shard.detach(), None, dst=0)
            return None
        whole = shard.new_empty(shard.numel() * self.size)
        dist.gather(shard.detach(), list(whole.view(self.size, -1).unbind(0)), dst=0)
        shape = self.shapes[name]
        return whole[: math.prod(shape)].view(shape)

    def reduce(self, whole: Tensor | None, shard: Tensor) -> Tensor:
        """This rank's slice of the sum over ranks of ``whole`` (None: zeros here)."""
        padded = shard.new_zeros(shard.numel() * self.size)
        if whole is not None:
            padded[: whole.numel()] = whole.reshape(-1)
        out = shard.new_empty(shard.numel())
        dist.reduce_scatter_single(out, padded)
        return out

    def all_sum(self, value: Tensor) -> Tensor:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value


@torch.no_grad()
def shard(model: TrainingModel) -> None:
    """Every rank: a whole model (the same on every rank) becomes this rank's shards;
    accumulated gradients are dropped."""
    sharding = FlatShards.of(model)
    opt = model.optimizer
    model.params = model.params.map(sharding.take)
    opt.params = dict(model.params.named_tensors())
    opt.exp_avg = {n: sharding.take(t) for n, t in opt.exp_avg.items()}
    opt.exp_avg_sq = {n: sharding.take(t) for n, t in opt.exp_avg_sq.items()}
    opt.reduce = sharding.all_sum
    model.sharding = sharding


@torch.no_grad()
def unshard(model: TrainingModel) -> None:
    """Every rank: the model becomes whole again (weights and moments gathered)."""
    sharding = _sharding(model)
    opt = model.optimizer
    _gather_weights(model, sharding)
    opt.exp_avg = {n: sharding.gather(n, t) for n, t in opt.exp_avg.items()}
    opt.exp_avg_sq = {n: sharding.gather(n, t) for n, t in opt.exp_avg_sq.items()}
    opt.reduce = None
    model.sharding = None


@contextmanager
def whole(model: TrainingModel, *, moments: bool) -> Iterator[None]:
    """Rank 0: the whole weights (and with ``moments`` the Adam moments) in the model
    for the duration, its shards back after (what the body changed is dropped).
    Every other rank calls ``send_whole`` at the same time."""
    sharding = _sharding(model)
    opt = model.optimizer
    kept = (model.params, opt.params, opt.exp_avg, opt.exp_avg_sq)
    with torch.no_grad():
        tensors = _to_root(sharding, opt.params)
        model.params = LlamaParams.from_state_dict(model.cfg, tensors)
        opt.params = dict(model.params.named_tensors())
        if moments:
            opt.exp_avg = _to_root(sharding, opt.exp_avg)
            opt.exp_avg_sq = _to_root(sharding, opt.exp_avg_sq)
    try:
        yield
    finally:
        model.params, opt.params, opt.exp_avg, opt.exp_avg_sq = kept


@torch.no_grad()
def send_whole(model: TrainingModel, *, moments: bool) -> None:
    """A rank other than 0: its shards to rank 0's ``whole``."""
    sharding = _sharding(model)
    opt = model.optimizer
    _to_root(sharding, opt.params)
    if moments:
        _to_root(sharding, opt.exp_avg)
        _to_root(sharding, opt.exp_avg_sq)


def _to_root(sharding: FlatShards, shards: dict[str, Tensor]) -> dict[str, Tensor]:
    """The whole tensors on rank 0, by name (empty on the others)."""
    out: dict[str, Tensor] = {}
    for name, shard in shards.items():
        whole_tensor = sharding.gather_to_root(name, shard)
        if whole_tensor is not None:
            out[name] = whole_tensor
    return out


_EMBED = "model.embed_tokens.weight"
_NORM = "model.norm.weight"
_HEAD = "lm_head.weight"


def forward_backward(
    model: TrainingModel, op: ForwardBackwardOp
) -> ForwardResult | Exception | None:
    """Every rank: its share of a ``ForwardBackward`` (possibly none: None), one layer
    at a time, as FSDP runs it.

    Forward, without a graph: the embedding, then each layer with its weights
    gathered, run, and freed (the layer's input kept); then the final norm, the
    head and the loss with their gradient. Backward, from the last layer to the
    first: the layer's weights gathered again, the layer recomputed from its
    input and differentiated, its weights' gradients reduce-scattered (the sum
    over ranks) and freed; the embedding's last. So at most the embedding, the
    head and one layer are whole at a time (``Sharding.gathered_bytes``), and the
    activations are those of activation checkpointing. The summed gradient is
    added to the shards' only once the whole pass is done (all or nothing, as
    ``trainer.accumulate_gradients``).

    The collectives run in the same order on every rank whatever its datums: a
    rank with none, or whose share failed (out of memory on one rank, say),
    still joins each gather and reduce-scatter (with zeros), and the failure is
    returned, not raised, once they are done; a failed collective raises."""
    return _LayerwisePass(model, op).run()


class _LayerwisePass:
    def __init__(self, model: TrainingModel, op: ForwardBackwardOp) -> None:
        self.model = model
        self.op = op
        self.cfg = model.cfg
        self.sharding = _sharding(model)
        self.shards = model.optimizer.params
        self.head_name = _HEAD if _HEAD in self.shards else _EMBED  # tied: the embedding
        self.failed: Exception | None = None
        self.active = bool(op.data)
        #: the summed gradient of each shard, added to its ``grad`` at the end
        self.parts: dict[str, Tensor] = {}

    def _attempt(self, compute: Callable[[], _R]) -> _R | None:
        """``compute()`` unless this rank has nothing to compute (no datums, or a failure)."""
        if not self.active or self.failed is not None:
            return None
        try:
            return compute()
        except Exception as err:  # returned once every collective of the pass ran
            self.failed = err
            return None

    def _reduce(self, name: str, whole: Tensor | None) -> None:
        if self.failed is not None:
            whole = None
        part = self.sharding.reduce(whole, self.shards[name])
        self.parts[name] = part if name not in self.parts else self.parts[name].add_(part)

    def _layer(self, n: int) -> tuple[LayerParams, dict[str, Tensor]]:
        """Layer ``n`` with its weights gathered whole (and those by name)."""
        shard = self.model.params.layers[n]
        tensors: dict[str, Tensor] = {}
        changes: dict[str, Tensor] = {}
        for f in fields(shard):
            if getattr(shard, f.name) is None:
                continue
            name = layer_tensor_name(n, f.name)
            tensors[name] = changes[f.name] = self.sharding.gather(name, self.shards[name])
        return replace(shard, **changes), tensors

    def run(self) -> ForwardResult | Exception | None:
        cfg, op, model = self.cfg, self.op, self.model
        prep = self._attempt(partial(trainer.prepare_forward_backward, model, op))
        if prep is not None and prep.needs_reference:
            self._attempt(partial(trainer.fill_reference, model, prep, op.temperature))
        inputs: list[Tensor] = []  # each layer's input (the last: the final hidden)

        with torch.no_grad():
            embed = self.sharding.gather(_EMBED, self.shards[_EMBED])
            rope = self._attempt(partial(_embedding, cfg, prep, embed, inputs))
            del embed
            for n in range(cfg.num_layers):
                layer, _ = self._layer(n)
                self._attempt(partial(_forward_layer, cfg, layer, n, inputs, rope))
                del layer

        norm = self.sharding.gather(_NORM, self.shards[_NORM]).requires_grad_(True)
        head = self.sharding.gather(self.head_name, self.shards[self.head_name])
        head.requires_grad_(True)
        tied = self.head_name == _EMBED
        head_out = self._attempt(partial(_head, model, op, prep, norm, head, tied, inputs))
        outcome, grad, g_norm, g_head = head_out if head_out else (None, None, None, None)
        del norm, head
        self._reduce(_NORM, g_norm)
        self._reduce(self.head_name, g_head)
        del g_norm, g_head

        for n in reversed(range(cfg.num_layers)):
            layer, tensors = self._layer(n)
            back = self._attempt(
                partial(_backward_layer, cfg, layer, tensors, n, inputs, rope, grad)
            )
            grad, layer_grads = back if back else (None, {})
            del layer, tensors
            for name in [k for k in self.shards if k.startswith(f"model.layers.{n}.")]:
                self._reduce(name, layer_grads.pop(name, None))

        with torch.no_grad():
            shape = self.sharding.shapes[_EMBED]
            self._reduce(_EMBED, self._attempt(partial(_embedding_grad, shape, prep, grad)))
            if self.failed is not None:
                return self.failed
            for name, part in self.parts.items():
                shard = self.shards[name]
                shard.grad = part if shard.grad is None else shard.grad.add_(part)
        return outcome


# ---- one rank's compute of a layer-wise pass (``_LayerwisePass``) -----------------------

Rope = tuple[Tensor, Tensor]


def _embedding(
    cfg: ModelConfig, prep: PreparedForwardBackward | None, embed: Tensor, inputs: list[Tensor]
) -> Rope:
    assert prep is not None
    tokens_B_T = prep.batch.tokens_B_T
    B, T = tokens_B_T.shape
    positions_B_T = torch.arange(T, device=tokens_B_T.device).expand(B, T)
    x_B_T_H = F.embedding(tokens_B_T, embed)
    inputs.append(x_B_T_H)
    return rope_cos_sin(cfg, positions_B_T, x_B_T_H.dtype)


def _forward_layer(
    cfg: ModelConfig, layer: LayerParams, n: int, inputs: list[Tensor], rope: Rope | None
) -> None:
    assert rope is not None
    inputs.append(decoder_layer(cfg, layer, n, inputs[-1], *rope))


def _head(
    model: TrainingModel,
    op: ForwardBackwardOp,
    prep: PreparedForwardBackward | None,
    norm: Tensor,
    head: Tensor,
    tied: bool,
    inputs: list[Tensor],
) -> tuple[ForwardResult, Tensor | None, Tensor | None, Tensor | None]:
    """The final norm, the head and the loss, and their gradients (the final
    hidden's, the norm's, the head's)."""
    assert prep is not None
    h_B_T_H = inputs.pop().requires_grad_(True)
    hidden_B_T_H = rms_norm(h_B_T_H, norm, model.cfg.rms_norm_eps)
    params = LlamaParams(embed_tokens=head, layers=[], norm=norm, lm_head=None if tied else head)
    lp_B_T, entropy_B_T = trainer.logprobs_of_hidden(
        model.cfg, params, hidden_B_T_H, prep.batch.targets_B_T, op.temperature, with_entropy=True
    )
    loss, result = trainer.finish_forward_backward(model, op, prep, lp_B_T, entropy_B_T)
    with record_function("treadle.backward"):
        g_h, g_norm, g_head = torch.autograd.grad(loss, [h_B_T_H, norm, head], allow_unused=True)
    return result, g_h, g_norm, g_head


def _backward_layer(
    cfg: ModelConfig,
    layer: LayerParams,
    tensors: dict[str, Tensor],
    n: int,
    inputs: list[Tensor],
    rope: Rope | None,
    grad: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor | None]]:
    """Layer ``n`` recomputed from its input and differentiated: the gradient of its
    input and of its weights."""
    assert rope is not None and grad is not None
    x_B_T_H = inputs.pop().requires_grad_(True)
    for t in tensors.values():
        t.requires_grad_(True)
    y_B_T_H = decoder_layer(cfg, layer, n, x_B_T_H, *rope)
    with record_function("treadle.backward"):
        out = torch.autograd.grad(y_B_T_H, [x_B_T_H, *tensors.values()], grad, allow_unused=True)
    assert out[0] is not None
    return out[0], dict(zip(tensors, out[1:], strict=True))


def _embedding_grad(
    shape: tuple[int, ...], prep: PreparedForwardBackward | None, grad: Tensor | None
) -> Tensor:
    """The embedding's gradient: each position's gradient added to its token's row."""
    assert prep is not None and grad is not None
    whole = grad.new_zeros(shape)
    return whole.index_add_(0, prep.batch.tokens_B_T.reshape(-1), grad.reshape(-1, shape[1]))


def _sharding(model: TrainingModel) -> FlatShards:
    if not isinstance(model.sharding, FlatShards):
        raise TypeError(f"model {model.spec.model_id} is not sharded")
    return model.sharding


def _gather_weights(model: TrainingModel, sharding: FlatShards) -> None:
    tensors = {n: sharding.gather(n, t) for n, t in model.optimizer.params.items()}
    model.params = LlamaParams.from_state_dict(model.cfg, tensors)
    model.optimizer.params = dict(model.params.named_tensors())
