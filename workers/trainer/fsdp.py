"""A full fine-tune sharded over a group of ranks (``--ranks N``) with FSDP2
(``torch.distributed.fsdp.fully_shard``): each rank keeps 1/N of every trainable
tensor (a DTensor, ``Shard(0)``: its rows split as ``torch.chunk`` splits them),
of its gradient and of its two AdamW moments.

treadle's forward is functional (``workers.model.llama``), so the model is put in
thin ``nn.Module`` wrappers for FSDP: one module per decoder layer, holding the
layer's tensors as parameters and running the same ``decoder_layer``, and a root
holding the embedding, the final norm and the head. Each layer is a
``fully_shard`` unit (resharded after its forward, so one layer is whole at a
time, plus the next one FSDP prefetches in the backward), the root another (its
embedding, norm and head stay whole for the pass). A layer's forward runs under
activation checkpointing (``torch.utils.checkpoint``): only its input is kept,
and the backward recomputes it with the weights FSDP gathered again.

FSDP all-gathers the weights and reduce-scatters the gradients; it is told to
sum them (``set_gradient_divide_factor(1.0)``): losses are sums, so the
gradient of the step is the sum over ranks, as on one rank. treadle's AdamW
steps each rank's local shards (``DTensor.to_local()``: views of FSDP's own
storage, so the step moves FSDP's parameters in place), with the clip and update
norms summed over the group (``AdamW.reduce``): every metric is the whole
model's. ``forward_logprobs`` runs on the shards like a ``forward_backward``
(each rank its share of the datums, no gradient). A read of the whole weights on
rank 0 gathers them there one tensor at a time (``DTensor.full_tensor()``; the
other ranks drop theirs), each written or copied and dropped in turn: a
checkpoint, an export, a published version (``workers.trainer.whole``).

Every function here is a collective: each rank calls it in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from treadle.common.engine.domain import ForwardBackwardOp, ForwardLogprobsOp, ForwardResult
from treadle.common.engine.model_config import ModelConfig
from treadle.workers.model.llama import Lora, decoder_layer, lm_logits, rms_norm, rope_cos_sin
from treadle.workers.model.lora import LoraAdapter
from treadle.workers.model.params import LayerParams, LlamaParams
from treadle.workers.trainer import trainer
from treadle.workers.trainer.trainer import PreparedForwardBackward, Sharding, TrainingModel

_R = TypeVar("_R")

#: what the root's forward hands its final hidden states and head weights to
Head = Callable[[Tensor, LlamaParams], _R]


class _Layer(nn.Module):
    """Decoder layer ``n``'s tensors as parameters (FSDP's unit), run by the same
    functional ``decoder_layer`` as one rank runs, under activation checkpointing.
    ``trainable`` False: a frozen base's (no gradient, so FSDP reduce-scatters
    nothing for them)."""

    def __init__(self, cfg: ModelConfig, n: int, layer: LayerParams, trainable: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.n = n
        self.names = [f.name for f in fields(layer) if getattr(layer, f.name) is not None]
        for name in self.names:
            tensor = getattr(layer, name).detach()
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=trainable))

    def params(self) -> LayerParams:
        """The layer's tensors now: whole inside FSDP's forward, shards outside it."""
        return LayerParams(**{name: getattr(self, name) for name in self.names})

    def forward(
        self, x_B_T_H: Tensor, cos: Tensor, sin: Tensor, lora: Lora | None = None
    ) -> Tensor:
        # read the weights inside the checkpointed function: the recompute in the
        # backward then uses those FSDP gathered again (and the same adapter)
        out: Tensor = checkpoint(self._run, x_B_T_H, cos, sin, lora, use_reentrant=False)
        return out

    def _run(self, x_B_T_H: Tensor, cos: Tensor, sin: Tensor, lora: Lora | None) -> Tensor:
        return decoder_layer(self.cfg, self.params(), self.n, x_B_T_H, cos, sin, lora)


class _Model(nn.Module):
    """The root: embedding, layers, final norm and head (``None`` when tied)."""

    def __init__(self, cfg: ModelConfig, params: LlamaParams, trainable: bool) -> None:
        super().__init__()
        self.cfg = cfg

        def param(t: Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach(), requires_grad=trainable)

        self.embed_tokens = param(params.embed_tokens)
        self.layers = nn.ModuleList(
            _Layer(cfg, n, p, trainable) for n, p in enumerate(params.layers)
        )
        self.norm = param(params.norm)
        self.lm_head = None if params.lm_head is None else param(params.lm_head)

    def params(self) -> LlamaParams:
        """Every tensor, as ``LlamaParams`` (HF names through ``named_tensors``)."""
        layers = [layer.params() for layer in self.layers if isinstance(layer, _Layer)]
        return LlamaParams(self.embed_tokens, layers, self.norm, self.lm_head)

    def forward(self, tokens_B_T: Tensor, head: Head[_R], lora: Lora | None = None) -> _R:
        """``head`` of the final-norm hidden states of ``tokens_B_T``: what
        ``forward_hidden`` computes (with ``lora``: with that adapter, or each row's
        (``LoraRows``), on the layers; the head applies its own part), one FSDP layer
        at a time."""
        cfg = self.cfg
        B, T = tokens_B_T.shape
        positions_B_T = torch.arange(T, device=tokens_B_T.device).expand(B, T)
        x_B_T_H = F.embedding(tokens_B_T, self.embed_tokens)
        cos, sin = rope_cos_sin(cfg, positions_B_T, x_B_T_H.dtype)
        for layer in self.layers:
            x_B_T_H = layer(x_B_T_H, cos, sin, lora)
        hidden_B_T_H = rms_norm(x_B_T_H, self.norm, cfg.rms_norm_eps)
        whole = LlamaParams(self.embed_tokens, [], self.norm, self.lm_head)
        return head(hidden_B_T_H, whole)


class FsdpShards(Sharding):
    """A model's FSDP2 root (every layer a ``fully_shard`` unit) over the default
    process group: a full fine-tune's own, or a frozen base's (``frozen``), which
    every LoRA model on that base shares (``workers.trainer.sharded_base``)."""

    def __init__(self, root: _Model, mesh: DeviceMesh, gathered_bytes: int, frozen: bool) -> None:
        self.root = root
        self.mesh = mesh
        self.gathered_bytes = gathered_bytes
        self.frozen = frozen

    def params(self) -> LlamaParams:
        """The sharded parameters (DTensors, this rank's rows of each)."""
        return self.root.params()


def build(params: LlamaParams, cfg: ModelConfig, *, frozen: bool) -> FsdpShards:
    """Every rank: whole weights (the same on every rank) put in an FSDP2 root over
    the group, each layer a ``fully_shard`` unit, and sharded; ``params`` themselves
    are not changed (the shards are copies). ``frozen``: no gradient (a LoRA base)."""
    mesh = init_device_mesh(params.device.type, (dist.get_world_size(),))
    gathered = _gathered_bytes(params)
    root = _Model(cfg, params, trainable=not frozen)
    for layer in root.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(root, mesh=mesh)
    if not frozen:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                _sum_gradients(module)
    return FsdpShards(root, mesh, gathered, frozen)


def _sum_gradients(module: FSDPModule) -> None:
    """FSDP reduce-scatters ``module``'s gradients as a sum over the ranks."""
    module.set_gradient_divide_factor(1.0)  # the sum over ranks: losses are sums
    module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    # A weight that got no gradient on some rank reduce-scatters zeros there. torch
    # 2.11 (the GPU host's) has no such setter; it needs none here: every rank's
    # pass reaches every weight (a rank without datums runs ``_NoLoss``).
    reduce_unused = getattr(module, "set_reduce_scatter_unused_params", None)
    if reduce_unused is not None:
        reduce_unused(True, recurse=False)


def _gathered_bytes(params: LlamaParams) -> int:
    """The whole weights a pass holds at once: the root's (embedding, norm, head)
    and two layers (the one running and the one FSDP prefetches in the backward)."""
    element = params.embed_tokens.element_size()
    root = sum(
        t.numel() for t in (params.embed_tokens, params.norm, params.lm_head) if t is not None
    )
    layer = max(
        (sum(t.numel() for t in vars(p).values() if t is not None) for p in params.layers),
        default=0,
    )
    return (root + 2 * layer) * element


@torch.no_grad()
def shard(model: TrainingModel) -> None:
    """Every rank: a whole model (the same on every rank) becomes this rank's shards;
    accumulated gradients are dropped."""
    opt = model.optimizer
    sharding = build(model.params, model.cfg, frozen=False)
    model.params = sharding.params()
    opt.params = _locals(model)
    opt.exp_avg = {n: _my_rows(t, opt.params[n]) for n, t in opt.exp_avg.items()}
    opt.exp_avg_sq = {n: _my_rows(t, opt.params[n]) for n, t in opt.exp_avg_sq.items()}
    opt.reduce = _all_sum
    model.sharding = sharding


@torch.no_grad()
def unshard(model: TrainingModel) -> None:
    """Every rank: the model becomes whole again (weights and moments gathered)."""
    _sharding(model)
    opt = model.optimizer
    dtensors = dict(model.params.named_tensors())
    tensors = {n: _full(p) for n, p in dtensors.items()}
    opt.exp_avg = {n: _full_of(dtensors[n], t) for n, t in opt.exp_avg.items()}
    opt.exp_avg_sq = {n: _full_of(dtensors[n], t) for n, t in opt.exp_avg_sq.items()}
    model.params = LlamaParams.from_state_dict(model.cfg, tensors).requires_grad_(True)
    opt.params = dict(model.params.named_tensors())
    opt.reduce = None
    model.sharding = None  # the FSDP modules go with it


def forward_backward(
    model: TrainingModel, op: ForwardBackwardOp, base: Callable[[], FsdpShards]
) -> ForwardResult | Exception | None:
    """Every rank: its share of a ``ForwardBackward`` (possibly none: None) through the
    FSDP root, and the gradient of its summed loss: a full fine-tune's
    reduce-scattered (summed over ranks) and added to its shards' accumulated
    gradients; a LoRA model's (on its sharded frozen base) added to this rank's
    replica of the adapter, as on one rank (summed over ranks at the optimizer
    step, ``collectives.sum_gradients``).

    The reference logprobs a KL penalty wants (the base's) go through ``base``
    (the model's base sharded over the group, made on first use: a collective,
    which every rank reaches at once), with no gradient, on every rank when any
    rank's share wants them.

    A rank with no datums, or whose share failed its preparation, runs the pass
    on one token with a zero loss, so it joins every all-gather and
    reduce-scatter (adding zeros); that failure is returned, not raised. A
    failure inside the pass raises: the ranks' collectives are then out of
    step, and the group is not used again (``GroupPeers``)."""
    sharding = _sharding(model)
    failed: Exception | None = None
    prep: PreparedForwardBackward | None = None
    if op.data:
        try:
            prep = trainer.prepare_forward_backward(model, op)
        except Exception as err:  # returned once the pass's collectives ran
            failed, prep = err, None
    lora = model.adapter  # None on a full fine-tune
    try:
        wants_reference = prep is not None and prep.needs_reference
        if _on_any_rank(wants_reference, model.params.device):
            reference = base()
            _fill_reference(model, reference, prep if wants_reference else None, op.temperature)
            if reference is not sharding:  # a full fine-tune's base: whole no longer
                _reshard(reference)
        if prep is not None:
            finish = _Finish(model, op, prep)
            loss = sharding.root(prep.batch.tokens_B_T, finish, lora)
            outcome: ForwardResult | Exception | None = finish.result
        else:
            tokens = torch.zeros((1, 1), dtype=torch.int64, device=model.params.device)
            loss = sharding.root(tokens, _NoLoss(model.cfg, lora), lora)
            outcome = failed
        if sharding.frozen:
            trainer.accumulate_gradients(loss, [model])
        else:
            loss.backward()
    except RuntimeError:  # a collective's failure, or out of memory: the group breaks
        raise
    except Exception as err:  # any other: the ranks' collectives are out of step all the same
        raise RuntimeError(f"the FSDP pass failed: {type(err).__name__}: {err}") from err
    if not sharding.frozen:
        _take_gradients(model)
    return outcome


def _fill_reference(
    model: TrainingModel,
    sharding: FsdpShards,
    prep: PreparedForwardBackward | None,
    temperature: float,
) -> None:
    """Every rank, when any rank's share wants them: the reference logprobs (the base,
    the adapter off) of its share, through the sharded base with no gradient; a rank
    whose share does not want them runs one token, joining the all-gathers."""
    where = model.params.device
    if prep is None:
        tokens_B_T = targets_B_T = torch.zeros((1, 1), dtype=torch.int64, device=where)
    else:
        tokens_B_T, targets_B_T = prep.batch.tokens_B_T, prep.batch.targets_B_T
    with torch.no_grad():
        head = _Logprobs(model.cfg, targets_B_T, temperature, None)
        ref_B_T = sharding.root(tokens_B_T, head)
    if prep is not None:
        trainer.set_reference(model, prep, ref_B_T)


def forward_logprobs(
    model: TrainingModel, op: ForwardLogprobsOp, weights: FsdpShards, lora: LoraAdapter | None
) -> ForwardResult | Exception | None:
    """Every rank: the logprobs of its share of a ``ForwardLogprobs`` (None: it has no
    datums) through ``weights`` (a full fine-tune's own, or a sharded base) with
    ``lora`` on it (the model's adapter, another adapter, or None: the base), no
    gradient. FSDP gathers one layer at a time, as in a ``forward_backward``; a
    rank with no datums (or whose share failed its preparation: returned, not
    raised) runs one token, so it joins every all-gather. The root's embedding,
    norm and head are resharded after the pass (FSDP keeps a root whole after its
    forward, for the backward that a pass without gradient never runs)."""
    where = model.params.device
    failed: Exception | None = None
    batch: trainer.TrainBatch | None = None
    if op.data:
        try:
            batch = trainer.prepare_forward_logprobs(model, op)
        except Exception as err:  # returned once the pass's collectives ran
            failed = err
    if batch is None:
        tokens_B_T = targets_B_T = torch.zeros((1, 1), dtype=torch.int64, device=where)
    else:
        tokens_B_T, targets_B_T = batch.tokens_B_T, batch.targets_B_T
    try:
        with torch.no_grad():
            lp_B_T = weights.root(
                tokens_B_T, _Logprobs(model.cfg, targets_B_T, op.temperature, lora), lora
            )
        _reshard(weights)
        if not weights.frozen:  # FSDP's first forward may lay its shards out anew
            _refresh_locals(model)
    except RuntimeError:  # a collective's failure, or out of memory: the group breaks
        raise
    except Exception as err:  # any other: the ranks' collectives are out of step all the same
        raise RuntimeError(f"the FSDP pass failed: {type(err).__name__}: {err}") from err
    if batch is None:
        return failed
    return trainer.logprobs_result(model, batch, lp_B_T)


def _reshard(sharding: FsdpShards) -> None:
    """The root's own weights (embedding, norm, head) back to shards (the layers'
    are resharded after each layer's forward)."""
    cast(FSDPModule, sharding.root).reshard()


def _on_any_rank(flag: bool, where: torch.device) -> bool:
    value = torch.tensor([1 if flag else 0], dtype=torch.int64, device=where)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


class _Logprobs:
    """The head of a pass without gradient: the target logprobs (with ``lora``'s part
    of the head, if it adapts it; None: the base alone, a reference)."""

    def __init__(
        self, cfg: ModelConfig, targets_B_T: Tensor, temperature: float, lora: LoraAdapter | None
    ) -> None:
        self.cfg, self.targets_B_T, self.temperature = cfg, targets_B_T, temperature
        self.lora = lora

    def __call__(self, hidden_B_T_H: Tensor, params: LlamaParams) -> Tensor:
        lp_B_T, _ = trainer.logprobs_of_hidden(
            self.cfg,
            params,
            hidden_B_T_H,
            self.targets_B_T,
            self.temperature,
            with_entropy=False,
            lora=self.lora,
        )
        return lp_B_T


class _Finish:
    """The head of a real share: the target logprobs, the loss and the call's result."""

    def __init__(
        self, model: TrainingModel, op: ForwardBackwardOp, prep: PreparedForwardBackward
    ) -> None:
        self.model, self.op, self.prep = model, op, prep
        self.result: ForwardResult | None = None

    def __call__(self, hidden_B_T_H: Tensor, params: LlamaParams) -> Tensor:
        model, op, prep = self.model, self.op, self.prep
        lp_B_T, entropy_B_T = trainer.logprobs_of_hidden(
            model.cfg,
            params,
            hidden_B_T_H,
            prep.batch.targets_B_T,
            op.temperature,
            with_entropy=True,
            lora=model.adapter,
        )
        loss, self.result = trainer.finish_forward_backward(model, op, prep, lp_B_T, entropy_B_T)
        return loss


class _NoLoss:
    """The head of an empty share: zero, through every weight (the head's included)
    and the adapter's, so each of them gets a (zero) gradient to reduce-scatter (or,
    on a frozen base, the backward recomputes the same layers as the other ranks')."""

    def __init__(self, cfg: ModelConfig, lora: LoraAdapter | None) -> None:
        self.cfg = cfg
        self.lora = lora

    def __call__(self, hidden_B_T_H: Tensor, params: LlamaParams) -> Tensor:
        return lm_logits(self.cfg, params, hidden_B_T_H, lora=self.lora).sum() * 0.0


@torch.no_grad()
def _take_gradients(model: TrainingModel) -> None:
    """FSDP's sharded gradients (DTensors) added to the local shards' ``grad``, which
    the optimizer reads; the DTensors' are dropped, so the next pass starts at zero."""
    current = _refresh_locals(model)
    for name, p in model.params.named_tensors():
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        p.grad = None
        mine = current[name]
        mine.grad = g if mine.grad is None else mine.grad.add_(g)


def _refresh_locals(model: TrainingModel) -> dict[str, Tensor]:
    """The optimizer steps the local shards FSDP holds now: FSDP may lay its shards
    out anew at its first forward (lazy init); their gradients carried over."""
    opt = model.optimizer
    current = _locals(model)
    for name, t in current.items():
        if t is not opt.params[name]:
            t.grad = opt.params[name].grad
    opt.params = current
    return current


def _locals(model: TrainingModel) -> dict[str, Tensor]:
    """This rank's shard of each parameter, by HF name: views of FSDP's storage."""
    out: dict[str, Tensor] = {}
    for name, p in model.params.named_tensors():
        assert isinstance(p, DTensor)
        out[name] = p.to_local()
    return out


def _my_rows(whole_tensor: Tensor, mine: Tensor) -> Tensor:
    """This rank's rows of ``whole_tensor``, as FSDP shards a parameter (``torch.chunk``
    over dim 0; a rank past the last chunk has none)."""
    chunks = torch.chunk(whole_tensor.detach(), dist.get_world_size(), dim=0)
    rank = dist.get_rank()
    out = chunks[rank].clone() if rank < len(chunks) else whole_tensor.new_empty(mine.shape)
    if out.shape != mine.shape:
        raise AssertionError(f"shard of shape {tuple(out.shape)}, FSDP's is {tuple(mine.shape)}")
    return out


def _full(p: Tensor) -> Tensor:
    """The whole tensor of a sharded parameter (an all-gather)."""
    assert isinstance(p, DTensor)
    return p.full_tensor()


def _full_of(p: Tensor, local: Tensor) -> Tensor:
    """The whole tensor of ``local``, a shard laid out as parameter ``p``'s."""
    assert isinstance(p, DTensor)
    sharded = DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
    return sharded.full_tensor()


def _all_sum(value: Tensor) -> Tensor:
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def _sharding(model: TrainingModel) -> FsdpShards:
    if not isinstance(model.sharding, FsdpShards):
        raise TypeError(f"model {model.spec.model_id} is not sharded")
    return model.sharding
