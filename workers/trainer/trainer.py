"""The trainer: one training model's weights, gradients and optimizer, and the
forward passes of ``ForwardBackward`` / ``ForwardLogprobs``.

Every input check runs before any compute, so a rejected call leaves weights,
accumulated gradients and optimizer state exactly as they were.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from torch.profiler import record_function

from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ForwardResult,
    ModelSpec,
    OptimStepResult,
)
from treadle.common.engine.model_config import ModelConfig
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import BaseVersion, ReferenceCache, WeightSnapshot
from treadle.workers.model import shared_prefix
from treadle.workers.model.llama import LlamaParams, forward_hidden, lm_logits, target_logprobs
from treadle.workers.model.lora import HEAD, UNEMBED_TARGET, LoraAdapter, targets_for
from treadle.workers.model.published import WeightsKeeper, WholeWeights, clone_weights
from treadle.workers.model.streamed_file import Entry
from treadle.workers.trainer import losses
from treadle.workers.trainer import memory as train_memory
from treadle.workers.trainer.chunked_logprobs import chunked_target_logprobs
from treadle.workers.trainer.optimizer import AdamW
from treadle.workers.trainer.softmax_logprobs import target_logprobs_and_entropy
from treadle.workers.trainer.validation import (
    check_adam,
    check_temperature,
    common_input_keys,
    validate_data,
)

#: float32 logits larger than this are computed in chunks of positions (a 110M
#: model's 32k vocabulary: above 2,048 positions per call)
LOGITS_CHUNK_BYTES = 256 * 2**20


class Sharding:
    """How a model's weights are split over a group of ranks (FSDP2,
    ``workers.trainer.fsdp``): a full fine-tune's weights, gradients and Adam
    moments, or (``frozen``) a LoRA model's frozen base, its adapter replicated on
    every rank; None on a model held whole."""

    #: the most bytes of whole weights a ``ForwardBackward`` holds at once (the
    #: embedding, norm and head, and two layers: the one running and the one FSDP
    #: prefetches in the backward); a full fine-tune's whole gradients (the root's,
    #: a layer's and its reduce-scatter buffer) are counted as as much again
    gathered_bytes: int = 0
    #: the sharded weights are a frozen base: gathered, never given a gradient
    frozen: bool = False


class TrainingModel:
    """A tenant's model: a LoRA adapter on the shared frozen base, or a full copy."""

    def __init__(
        self,
        spec: ModelSpec,
        base: BaseModel,
        *,
        max_context: int | None = None,
        checkpoint_activations: bool = False,
        memory_limit_bytes: int = 0,
        base_params: LlamaParams | None = None,
    ) -> None:
        self.spec = spec
        #: recompute each layer in the backward instead of keeping its activations
        #: (long sequences: less memory for about one more forward of time)
        self.checkpoint_activations = checkpoint_activations
        #: what a ForwardBackward may need (``train_memory``); 0 = the device's available memory
        self.memory_limit_bytes = memory_limit_bytes
        self.base = base
        self.cfg = base.cfg
        #: the longest datum a training call takes: the sampler's context on this base
        #: (``SamplerLimits.context_of``), so training and sampling refuse alike
        self.max_context = min(
            max_context or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings
        )
        self.adapter: LoraAdapter | None
        if spec.is_lora:
            #: ``base_params``: what a LoRA model reads for the base where not the whole
            #: ``base.params`` (a group rank's shards of it: ``workers.trainer.sharded_base``)
            self.params = base.params if base_params is None else base_params
            alpha = spec.lora_alpha or float(spec.lora_rank)
            self.adapter = LoraAdapter(
                self.cfg,
                spec.lora_rank,
                alpha,
                seed=spec.seed,
                targets=targets_for(
                    train_attn=spec.train_attn,
                    train_mlp=spec.train_mlp,
                    train_unembed=spec.train_unembed,
                ),
                dtype=base.dtype,
                device=self.params.device,
                requires_grad=True,
            )
            trainable = dict(self.adapter.named_tensors())
        else:
            # its own copy, read from the checkpoint when the base is not in memory:
            # the base is loaded only if something else needs it (``BaseModel``)
            self.params = base.weights_copy().requires_grad_(True)
            self.adapter = None
            trainable = dict(self.params.named_tensors())
        self.optimizer = AdamW(trainable)
        #: set while the model is sharded over a group of ranks: a full fine-tune's
        #: ``params`` then holds FSDP's sharded parameters (DTensors) and ``trainable``
        #: this rank's local shards of them (``workers.trainer.fsdp``); a LoRA model's
        #: base is sharded and shared by every LoRA model on it, its adapter whole
        #: (``workers.trainer.sharded_base``)
        self.sharding: Sharding | None = None
        self.version = 0
        self.last_checkpoint_seq_id = 0
        #: references ``ForwardLogprobs`` loaded from checkpoints (``workers.trainer.reference``)
        self.references = ReferenceCache()

    @property
    def trainable(self) -> dict[str, Tensor]:
        return self.optimizer.params

    @property
    def publishes_a_copy(self) -> bool:
        """Whether ``published`` copies the weights: a full fine-tune whose weights
        moved from the base's (a LoRA version copies its adapter only)."""
        return self.adapter is None and self.optimizer.weights_moved

    def whole_weights(
        self, entries: Sequence[Entry], tensors: Iterator[tuple[str, Tensor]]
    ) -> WholeWeights:
        """The weights as ``published`` hands them to a keeper: ``tensors`` yields them
        whole in ``entries``' order (on a group, gathered one at a time)."""
        return WholeWeights(
            self.spec.model_id, self.version, self.cfg, tuple(entries), tensors, self.params.device
        )

    def snapshot(
        self, keep: WeightsKeeper = clone_weights, whole: WholeWeights | None = None
    ) -> WeightSnapshot:
        """A detached copy of the current weights, to publish as a version.

        A full fine-tune's weights are handed to ``keep`` one whole tensor at a time
        (``whole``; default: this model's own tensors, held whole here), which keeps
        them as the sampler backend reads them (``SamplerBackend.keep_weights``: a
        clone, one shared-memory buffer, a file); still the base's (no step, no
        loaded state), they are the base's, not a copy, as a base sampler's are."""
        if self.adapter is not None:
            return WeightSnapshot(
                self.spec.model_id, self.version, self.params, self.adapter.clone()
            )
        if not self.optimizer.weights_moved:
            return WeightSnapshot(self.spec.model_id, self.version, self.base, None)
        if whole is None:
            named = list(self.params.named_tensors())
            entries = [Entry.of(name, t) for name, t in named]
            whole = self.whole_weights(entries, ((n, t.detach()) for n, t in named))
        return WeightSnapshot(self.spec.model_id, self.version, keep(whole), None)

    def published(
        self, keep: WeightsKeeper = clone_weights, whole: WholeWeights | None = None
    ) -> WeightSnapshot | BaseVersion:
        """What ``SyncWeights`` publishes: ``snapshot``, except for a full fine-tune
        whose weights are still the base's (no step, no loaded state): a version
        that reads the base only when a sampler asks for it, so publishing the
        untrained model neither copies it nor loads the base."""
        if self.adapter is None and not self.optimizer.weights_moved:
            return BaseVersion(self.spec.model_id, self.version, self.base)
        return self.snapshot(keep, whole)

    def optim_step(self, cfg: AdamConfig) -> OptimStepResult:
        check_adam(cfg)
        metrics = self.optimizer.step(cfg)
        self.version += 1
        return OptimStepResult(step=self.version, metrics=metrics)


# ---- batches -----------------------------------------------------------------------


@dataclass(frozen=True)
class TrainBatch:
    """A call's datums as the trainer runs them: the one engine-internal shape of a
    ``DatumData`` (the domain's), made once per call, after every check.

    ``tokens_B_T`` and ``targets_B_T`` are padded to the longest datum
    (``valid_B_T`` marks the real positions, ``lengths`` each datum's);
    ``inputs`` holds a ``ForwardBackward``'s float ``loss_fn_inputs`` flattened to
    the valid positions, as the loss reads them (empty for ``ForwardLogprobs``;
    ``set_reference`` may add ``ref_logprobs``)."""

    tokens_B_T: Tensor
    targets_B_T: Tensor
    lengths: list[int]
    valid_B_T: Tensor  # bool, True on real (unpadded) positions
    inputs: dict[str, Tensor] = field(default_factory=dict)
    #: the tokens on the host, for planning (``prefix_layout``)
    host_tokens_B_T: np.ndarray | None = None

    @functools.cached_property
    def prefix_layout(self) -> shared_prefix.PrefixLayout | None:
        """The rows' shared prefixes, where computing each once pays
        (``workers.model.shared_prefix``): planned once per batch, on first use."""
        if self.host_tokens_B_T is None:
            return None
        return shared_prefix.plan(
            [row[:n] for row, n in zip(self.host_tokens_B_T, self.lengths, strict=True)]
        )


def _make_batch(
    data: Sequence[DatumData],
    pad_id: int,
    device: torch.device,
    inputs: dict[str, Tensor] | None = None,
) -> TrainBatch:
    lengths = [int(d.tokens.size) for d in data]
    B, T = len(data), max(lengths)
    tokens = np.full((B, T), pad_id, dtype=np.int64)
    targets = np.zeros((B, T), dtype=np.int64)
    for b, d in enumerate(data):
        tokens[b, : lengths[b]] = d.tokens
        if "target_tokens" in d.inputs:
            targets[b, : lengths[b]] = d.inputs["target_tokens"]
    valid = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return TrainBatch(
        torch.from_numpy(tokens).to(device),
        torch.from_numpy(targets).to(device),
        lengths,
        valid.to(device),
        inputs or {},
        tokens,
    )


def _flat_inputs(
    data: Sequence[DatumData], keys: Sequence[str], dtype: torch.dtype, device: torch.device
) -> dict[str, Tensor]:
    return {
        k: torch.from_numpy(np.concatenate([d.inputs[k] for d in data]).astype(np.float64)).to(
            dtype=dtype, device=device
        )
        for k in keys
    }


def _split(values_B_T: Tensor, lengths: list[int], np_dtype: type) -> tuple[np.ndarray, ...]:
    rows = values_B_T.detach().cpu()
    return tuple(rows[b, :n].numpy().astype(np_dtype) for b, n in enumerate(lengths))


def _np_dtype(model: TrainingModel) -> type:
    return np.float64 if model.base.dtype == torch.float64 else np.float32


# ---- forward passes ---------------------------------------------------------------


def _logprobs(
    model: TrainingModel,
    batch: TrainBatch,
    temperature: float,
    *,
    reference: bool,
    with_entropy: bool,
    weights: WeightSnapshot | None = None,
) -> tuple[Tensor, Tensor | None]:
    # ``weights``: a reference the tenant chose (a saved state, a kept version).
    # Otherwise the reference policy is the base model: the adapter off, or the
    # frozen base weights for a full fine-tune.
    if weights is not None:
        params, lora = weights.params, weights.adapter
    elif reference:
        params, lora = model.base.params, None
    else:
        params, lora = model.params, model.adapter
    checkpoint = model.checkpoint_activations and torch.is_grad_enabled()
    layout = None if checkpoint else batch.prefix_layout
    if layout is not None:  # GRPO's G completions of a prompt: the prompt computed once
        hidden = shared_prefix.forward_hidden_shared(model.cfg, params, layout, lora=lora)
    else:
        hidden = forward_hidden(
            model.cfg, params, batch.tokens_B_T, lora=lora, checkpoint_layers=checkpoint
        )
    return logprobs_of_hidden(
        model.cfg,
        params,
        hidden,
        batch.targets_B_T,
        temperature,
        with_entropy=with_entropy,
        lora=lora,
    )


def _adapts_head(lora: LoraAdapter | None) -> bool:
    return lora is not None and UNEMBED_TARGET in lora.a[HEAD]


def logprobs_of_hidden(
    cfg: ModelConfig,
    params: LlamaParams,
    hidden_B_T_H: Tensor,
    targets_B_T: Tensor,
    temperature: float,
    *,
    with_entropy: bool,
    lora: LoraAdapter | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Target logprobs (and entropy) of final hidden states: through whole logits, or
    in chunks of positions when the logits would exceed ``LOGITS_CHUNK_BYTES``
    (long sequences x large vocabulary; ``workers.trainer.chunked_logprobs``). An adapter
    on the unembedding takes the whole-logits path (the chunked backward knows
    only the head's own weight)."""
    B, T, _ = hidden_B_T_H.shape
    if not _adapts_head(lora) and B * T * cfg.vocab_size * 4 > LOGITS_CHUNK_BYTES:
        return chunked_target_logprobs(
            hidden_B_T_H,
            params.lm_head_weight,
            targets_B_T,
            temperature,
            with_entropy=with_entropy,
        )
    logits = lm_logits(cfg, params, hidden_B_T_H, lora=lora)
    return logprobs_from_logits(logits, targets_B_T, temperature, with_entropy=with_entropy)


def logprobs_from_logits(
    logits_B_T_V: Tensor, targets_B_T: Tensor, temperature: float, *, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """Target logprobs ``[B, T]`` at ``temperature`` and (optionally, no grad) the entropy:
    one softmax for both and the gradient (``workers.trainer.softmax_logprobs``); a
    forward without either, one logsumexp."""
    if with_entropy or (torch.is_grad_enabled() and logits_B_T_V.requires_grad):
        return target_logprobs_and_entropy(
            logits_B_T_V, targets_B_T, temperature, with_entropy=with_entropy
        )
    return target_logprobs(logits_B_T_V, targets_B_T, temperature), None


@dataclass(frozen=True)
class PreparedForwardBackward:
    """A ``ForwardBackward`` call past every check: nothing left to reject.

    ``batch`` holds its datums and loss inputs; ``config`` the loss's settings,
    defaults filled in. ``needs_reference``: the loss wants ``ref_logprobs`` the
    client did not send, so a forward with the base weights must fill
    ``batch.inputs`` first (``set_reference``). The batched path
    (``workers.trainer.batching``) prepares calls with the same function, so both
    paths validate identically.
    """

    batch: TrainBatch
    config: dict[str, float]
    needs_reference: bool


def check_forward_logprobs(model: TrainingModel, op: ForwardLogprobsOp) -> None:
    """Every check of a ``ForwardLogprobs``'s input (INVALID_ARGUMENT), before any read."""
    _check_data(model, op)


def prepare_forward_logprobs(model: TrainingModel, op: ForwardLogprobsOp) -> TrainBatch:
    check_forward_logprobs(model, op)
    return _make_batch(op.data, model.cfg.pad_token_id or 0, model.params.device)


def prepare_forward_backward(
    model: TrainingModel, op: ForwardBackwardOp
) -> PreparedForwardBackward:
    keys, config = _check_loss_request(model, op)
    _check_memory(model, op.data)
    float_keys = [k for k in keys if k != "target_tokens"]
    inputs = _flat_inputs(op.data, float_keys, _loss_dtype(model), model.params.device)
    batch = _make_batch(op.data, model.cfg.pad_token_id or 0, model.params.device, inputs)
    need_ref = losses.needs_reference(op.loss_fn, config) and "ref_logprobs" not in inputs
    return PreparedForwardBackward(batch, config, need_ref)


def check_call(model: TrainingModel, op: ForwardBackwardOp | ForwardLogprobsOp) -> None:
    """The checks of ``prepare_*`` that do not depend on how a call's datums are split
    over a group's ranks (all but the memory a share needs), with the messages one
    rank gives (a datum named by its index in the whole call)."""
    if isinstance(op, ForwardBackwardOp):
        _check_loss_request(model, op)
    else:
        _check_data(model, op)


def _check_data(model: TrainingModel, op: ForwardBackwardOp | ForwardLogprobsOp) -> None:
    check_temperature(op.temperature)
    validate_data(op.data, model.cfg.vocab_size, model.max_context)


def _check_loss_request(
    model: TrainingModel, op: ForwardBackwardOp
) -> tuple[list[str], dict[str, float]]:
    """The call's input keys and its loss's settings (defaults filled in)."""
    _check_data(model, op)
    keys = common_input_keys(op.data)
    return keys, losses.validate_loss_request(op.loss_fn, keys, op.loss_config)


def _check_memory(model: TrainingModel, data: Sequence[DatumData]) -> None:
    """RESOURCE_EXHAUSTED before any compute when the batch would not fit."""
    rows, length = len(data), max(int(d.tokens.size) for d in data)
    element = model.params.embed_tokens.element_size()
    # a sharded model runs one FSDP layer at a time, each recomputed in the backward
    checkpointing = model.checkpoint_activations or model.sharding is not None
    need = train_memory.activation_bytes(
        model.cfg,
        rows,
        length,
        element,
        checkpointing=checkpointing,
        chunked_logits=not _adapts_head(model.adapter)
        and rows * length * model.cfg.vocab_size * 4 > LOGITS_CHUNK_BYTES,
    )
    if model.sharding is not None:  # the weights gathered at once (and their gradients)
        need += (1 if model.sharding.frozen else 2) * model.sharding.gathered_bytes
    if model.sharding is None or model.sharding.frozen:  # whole gradients: an adapter's
        need += sum(p.numel() * p.element_size() for p in model.trainable.values())
    train_memory.check_fits(
        need,
        model.memory_limit_bytes,
        model.params.device,
        checkpointing=checkpointing,
    )


def fill_reference(model: TrainingModel, prep: PreparedForwardBackward, temperature: float) -> None:
    """The reference logprobs a loss wants and the client did not send: the base's."""
    with torch.no_grad():
        ref_B_T, _ = _logprobs(model, prep.batch, temperature, reference=True, with_entropy=False)
    set_reference(model, prep, ref_B_T)


def set_reference(model: TrainingModel, prep: PreparedForwardBackward, ref_B_T: Tensor) -> None:
    prep.batch.inputs["ref_logprobs"] = ref_B_T[prep.batch.valid_B_T].to(_loss_dtype(model))


def finish_forward_backward(
    model: TrainingModel,
    op: ForwardBackwardOp,
    prep: PreparedForwardBackward,
    lp_B_T: Tensor,
    entropy_B_T: Tensor | None,
) -> tuple[Tensor, ForwardResult]:
    """The call's summed loss (to backward) and its result, from its logprobs."""
    valid = prep.batch.valid_B_T
    entropy_N = entropy_B_T[valid] if entropy_B_T is not None else None
    rows_B_T = torch.arange(valid.shape[0], device=valid.device)[:, None].expand_as(valid)
    result = losses.compute_loss(
        op.loss_fn,
        losses.LossBatch(lp_B_T[valid], prep.batch.inputs, entropy_N, rows_B_T[valid]),
        prep.config,
    )
    out = ForwardResult(
        logprobs=_split(lp_B_T, prep.batch.lengths, _np_dtype(model)),
        metrics=dict(result.metrics),
    )
    return result.loss, out


def logprobs_result(model: TrainingModel, batch: TrainBatch, lp_B_T: Tensor) -> ForwardResult:
    return ForwardResult(logprobs=_split(lp_B_T, batch.lengths, _np_dtype(model)), metrics={})


def forward_logprobs(
    model: TrainingModel, op: ForwardLogprobsOp, weights: WeightSnapshot | None = None
) -> ForwardResult:
    """Logprobs under the model's weights, the base (``op.reference``), or ``weights``
    (``op.reference_weights`` resolved by ``workers.trainer.reference``); no gradient."""
    return logprobs_of_batch(model, op, prepare_forward_logprobs(model, op), weights)


def logprobs_of_batch(
    model: TrainingModel,
    op: ForwardLogprobsOp,
    batch: TrainBatch,
    weights: WeightSnapshot | None = None,
) -> ForwardResult:
    """:func:`forward_logprobs` of a batch :func:`prepare_forward_logprobs` made."""
    with torch.no_grad():
        lp_B_T, _ = _logprobs(
            model,
            batch,
            op.temperature,
            reference=op.reference,
            with_entropy=False,
            weights=weights,
        )
    return logprobs_result(model, batch, lp_B_T)


def forward_backward(model: TrainingModel, op: ForwardBackwardOp) -> ForwardResult:
    """Add the gradient of the summed loss to the accumulated gradients."""
    prep = prepare_forward_backward(model, op)
    if prep.needs_reference:
        fill_reference(model, prep, op.temperature)
    lp_B_T, entropy_B_T = _logprobs(
        model, prep.batch, op.temperature, reference=False, with_entropy=True
    )
    loss, result = finish_forward_backward(model, op, prep, lp_B_T, entropy_B_T)
    accumulate_gradients(loss, [model])
    return result


def accumulate_gradients(loss: Tensor, models: Sequence[TrainingModel]) -> None:
    """Add d(loss)/d(weights) to each model's accumulated gradients, all or nothing.

    The gradients are computed first (``torch.autograd.grad``) and added only
    once all of them exist, so a call that fails on the way (out of memory in
    the backward, say) leaves the gradients of the calls before it exactly as
    they were: the model stays at its last applied call.
    """
    unique = list({id(m): m for m in models}.values())  # a model may have several calls
    params = [p for m in unique for p in m.trainable.values() if p.requires_grad]
    with record_function("treadle.backward"):  # named ranges: benchmarks/train_step.py --profile
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    with torch.no_grad(), record_function("treadle.accumulate"):
        for p, g in zip(params, grads, strict=True):
            if g is None:
                continue
            if p.grad is None:
                # a tensor of its own: a batched pass's gradient can be a strided view
                # into one buffer of several adapters' (``LoraRows`` stacks their B
                # matrices), which the fused AdamW and gloo both read as if dense
                p.grad = g.contiguous()
            else:
                p.grad.add_(g)


def _loss_dtype(model: TrainingModel) -> torch.dtype:
    return model.base.dtype if model.base.dtype == torch.float64 else torch.float32
