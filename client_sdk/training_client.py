"""TrainingClient: the ordered training primitives of one model.

Every call gets the next ``seq_id`` at submission and goes out at once; the
engine applies them in ``seq_id`` order, so a ``forward_backward`` and its
``optim_step`` can be in flight together, and a retried call is applied once.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import grpc

from treadle import _convert, custom_loss
from treadle._ordering import OrderedCalls
from treadle._rpc import error_from_rpc
from treadle.custom_loss import CustomLossFn
from treadle.errors import InvalidArgumentError
from treadle.futures import APIFuture
from treadle.sampling_client import SamplingClient
from treadle.types import (
    AdamParams,
    CheckpointInfo,
    Datum,
    ForwardBackwardOutput,
    ModelInfo,
    OptimStepResponse,
    RunUsage,
    SaveStateResponse,
)

if TYPE_CHECKING:
    from treadle.service_client import ServiceClient
    from treadle.tokenizer import Tokenizer


class TrainingClient:
    def __init__(self, service: ServiceClient, info: ModelInfo) -> None:
        self._service = service
        self.model_id = info.model_id
        self.base_model = info.base_model
        self._info = info
        self._seqs = OrderedCalls(
            service._caller,
            info.model_id,
            info.next_seq_id,
            auto_resync=service.auto_resync,
            log_bytes=service.resync_log_bytes,
        )

    # ---- sequence numbers ---------------------------------------------------------

    def _take_seq(self) -> int:
        return self._seqs.take()

    def resync(self) -> int:
        """Continue from the server's next expected seq_id; returns it.

        After a server restart brought the model back at its last checkpoint
        (``ServerRestartedError`` names it), the calls numbered after that
        checkpoint are gone: the next calls are numbered from the model's next
        expected seq_id, and calls of the old numbering still pending fail
        (ABORTED) instead of being applied out of place. Redo the steps since the
        checkpoint (``ServerRestartedError.step``) from there. docs/restarts.md"""
        info = self.get_info()
        self._seqs.reset(info.next_seq_id)
        return info.next_seq_id

    def _call(
        self, method: Any, request: Any, convert: Callable[[Any], Any], *, commits: bool = False
    ) -> APIFuture[Any]:
        return APIFuture(self._seqs.send(method, request, convert, commits=commits))

    def _wait_sent(self) -> None:
        """Wait until every ordered call sent so far has been applied (or failed):
        they apply in seq_id order, so waiting for the latest is enough."""
        last = self._seqs.last
        if last is not None:
            concurrent.futures.wait([last])

    # ---- the primitives -------------------------------------------------------------

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        temperature: float = 1.0,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Accumulate the gradient of ``sum(loss)`` over ``data`` (no hidden mean)."""
        request = _convert.forward_backward_request(
            self.model_id, data, loss_fn, loss_fn_config, temperature
        )
        request.seq_id = self._take_seq()
        return self._call(
            self._service._training.ForwardBackward, request, _convert.forward_output_from_wire
        )

    def forward_logprobs(
        self, data: Sequence[Datum], *, reference: bool | str = False, temperature: float = 1.0
    ) -> APIFuture[ForwardBackwardOutput]:
        """Per-token logprobs of each datum's targets, under the model's current weights.

        ``reference=True`` uses the base model (adapter off). ``reference="treadle://..."``
        uses weights you own instead: a state from ``save_state``
        (``treadle://<model_id>/state/<name>``) or a published version still kept
        (``treadle://<model_id>/v/<v>``), e.g. the end of a supervised warm-up, so a KL
        penalty does not pull the policy back to the random start. The model's own
        weights, gradients and optimizer state are untouched; the server keeps the
        loaded reference, so calling this every step reads the checkpoint once.
        """
        if isinstance(reference, str) and not reference:
            raise InvalidArgumentError(
                "reference: an empty path; pass a treadle:// path, True (the base model) "
                "or False (the model itself)"
            )
        request = _convert.forward_logprobs_request(self.model_id, data, reference, temperature)
        request.seq_id = self._take_seq()
        return self._call(
            self._service._training.ForwardLogprobs, request, _convert.forward_output_from_wire
        )

    def forward_backward_custom(
        self, data: Sequence[Datum], loss_fn: CustomLossFn, *, temperature: float = 1.0
    ) -> APIFuture[ForwardBackwardOutput]:
        """Accumulate the gradient of any torch loss of the logprobs, computed here.

        ``loss_fn(data, logprobs_list) -> (loss, metrics)`` gets one 1-D tensor per
        datum (requires grad) and returns a scalar tensor and a dict. The SDK runs
        ``forward_logprobs``, evaluates ``loss_fn``, and sends ``cross_entropy``
        with weights ``-dloss/dlogprob``, which has the same gradient. The output's
        metrics are the server's plus the user's, with ``loss:sum`` = the user's loss.

        Blocks the calling thread until the logprobs are back and ``loss_fn`` has
        run (so calls made after it returns are ordered after both of its calls);
        the backward is returned as a future. Uses two ``seq_id`` s. Needs torch on
        the client, for this call only (``treadle.custom_loss``).
        """
        return custom_loss.forward_backward_custom(self, data, loss_fn, temperature=temperature)

    async def forward_backward_custom_async(
        self, data: Sequence[Datum], loss_fn: CustomLossFn, *, temperature: float = 1.0
    ) -> ForwardBackwardOutput:
        """``forward_backward_custom`` without blocking the event loop."""
        return await custom_loss.forward_backward_custom_async(
            self, data, loss_fn, temperature=temperature
        )

    def optim_step(self, adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        request = _convert.optim_step_request(self.model_id, adam_params or AdamParams())
        request.seq_id = self._take_seq()
        return self._call(
            self._service._training.OptimStep,
            request,
            lambda r: _convert.optim_step_from_wire(r, self.model_id),
        )

    def sync_weights(
        self, *, inflight: bool = False, placement: str | None = None
    ) -> SamplingClient:
        """Publish the current weights as version v (= optimizer steps applied) and
        return a sampler pinned to it. Returns at once; sampling calls made on the
        client wait for the sync to land.

        ``inflight=True`` (PipelineRL): sequences still generating on a sampler
        following this model's ``latest`` weights continue under the new weights
        from their next decode step (their later tokens carry the new version;
        their KV cache is kept, docs/engine.md). The model needs such a sampler
        (``create_sampling_client(weights=f"treadle://{model_id}/latest")``),
        else the sync fails with INVALID_ARGUMENT.

        ``placement``: where the returned sampler samples, as for
        ``ServiceClient.create_sampling_client`` (``"colocated"``, ``"pool"``,
        ``"auto"``; None: the server's ``--sampler-placement``). ``"pool"`` with no
        sampler worker of the model's base fails the sync (FailedPreconditionError
        naming the base model, not retried; nothing is published) when the sampler
        is first used."""
        request = _convert.sync_weights_request(self.model_id, inflight, placement)
        request.seq_id = self._take_seq()
        info: Future[_convert.SamplerRef] = self._seqs.send(
            self._service._training.SyncWeights,
            request,
            lambda r: _convert.synced_sampler_from_wire(r, self.base_model, self.model_id),
        )
        return SamplingClient(self._service, info)

    def save_state(self, name: str) -> APIFuture[SaveStateResponse]:
        """Checkpoint weights + optimizer state + step; returns a ``treadle://`` path."""
        request = _convert.save_state_request(self.model_id, name)
        request.seq_id = self._take_seq()
        return self._call(
            self._service._training.SaveState,
            request,
            _convert.saved_state_from_wire,
            commits=True,
        )

    def load_state(self, path: str, *, weights_only: bool = False) -> APIFuture[int]:
        """Replace this model's weights, optimizer state and step with a checkpoint's
        (with ``weights_only``: its weights and step; the Adam moments start fresh)."""
        request = _convert.load_state_request(self.model_id, path, weights_only)
        request.seq_id = self._take_seq()
        return self._call(self._service._training.LoadState, request, lambda r: int(r.step))

    # ---- information --------------------------------------------------------------

    def get_info(self) -> ModelInfo:
        request = _convert.model_info_request(self.model_id)
        return self._service._caller.call(
            self._service._training.GetModelInfo, request, _convert.model_info_from_wire
        ).result()

    def list_checkpoints(self) -> list[CheckpointInfo]:
        request = _convert.list_checkpoints_request(self.model_id)
        return self._service._caller.call(
            self._service._training.ListCheckpoints,
            request,
            lambda r: [_convert.checkpoint_from_wire(c) for c in r.checkpoints],
        ).result()

    def delete_checkpoint(self, path: str) -> None:
        """Delete a ``treadle://`` checkpoint (of this tenant) and its stored files."""
        self._service.delete_checkpoint(path)

    # ---- the run's own metrics and usage ----------------------------------------------

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Keep the client's own metrics of a step with the run (rewards, evaluation
        scores): the console draws them beside the server's loss and grad norm. A
        name logged again for a step replaces its value. Not ordered with the
        training calls (it takes no seq_id); returns once the server kept them."""
        request = _convert.log_metrics_request(self.model_id, step, metrics)
        self._service._caller.call(
            self._service._training.LogMetrics, request, lambda r: None
        ).result()

    def get_usage(self) -> RunUsage:
        """What this run used so far: tokens trained, sampled (by its samplers) and
        scored, calls, device-seconds, and the cost at the server's prices."""
        request = _convert.usage_request(self.model_id)
        return self._service._caller.call(
            self._service._training.GetUsage, request, _convert.usage_from_wire
        ).result()

    def restore(self) -> ModelInfo:
        """Load the model back now if the server unloaded it for idling (the next
        call would do it anyway); the model's info."""
        return self._service.restore_model(self.model_id)

    def export_weights(self, out_dir: str | os.PathLike[str], merged: bool = False) -> Path:
        """Download the model's current weights into ``out_dir``, after every call
        sent before this one has been applied.

        ``merged=False``: a PEFT adapter directory (``adapter_config.json`` +
        ``adapter_model.safetensors``), LoRA models only. ``merged=True``: a HF
        checkpoint with the adapter folded into the base weights (``config.json``
        + ``model.safetensors`` + tokenizer files), which
        ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads.
        """
        self._wait_sent()
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        request = _convert.export_weights_request(self.model_id, merged)
        stream = self._service._training.ExportWeights(
            request, metadata=self._service._caller.call_metadata()
        )
        files: dict[str, BinaryIO] = {}
        try:
            for chunk in stream:
                name = Path(chunk.file_name).name  # never a path outside out_dir
                if name not in files:
                    files[name] = open(out / name, "wb")  # noqa: SIM115 (closed below)
                files[name].write(chunk.data)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        finally:
            for f in files.values():
                f.close()
        return out

    def get_tokenizer(self) -> Tokenizer:
        return self._service.get_tokenizer(self.base_model)

    # ---- tinker-compatible aliases ------------------------------------------------

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        temperature: float = 1.0,
    ) -> APIFuture[ForwardBackwardOutput]:
        """tinker's name for a forward-only pass (``forward_logprobs``): the per-token
        logprobs of each datum's targets. They are the same under every loss, so
        ``loss_fn`` is only checked to be a known name; a ``loss_fn_config`` would
        change nothing here and is refused (``forward_backward`` takes one)."""
        _convert.loss_fn_to_wire(loss_fn)
        if loss_fn_config:
            raise TypeError(
                "forward() returns the targets' logprobs only and takes no loss_fn_config "
                f"(got {sorted(loss_fn_config)}); pass it to forward_backward()"
            )
        return self.forward_logprobs(data, temperature=temperature)

    def save_weights_and_get_sampling_client(
        self, name: str | None = None, *, placement: str | None = None
    ) -> SamplingClient:
        """tinker's name for ``sync_weights``. The published weights are named by the
        server (``treadle://<model_id>/v/<version>``), so a ``name`` is refused: to keep
        the weights under a name of yours, call ``save_state(name)``. ``placement``:
        as for ``sync_weights``."""
        if name is not None:
            raise TypeError(
                f"save_weights_and_get_sampling_client(name={name!r}): treadle names the "
                "published weights treadle://<model_id>/v/<version> itself; call "
                "save_state(name) to keep them under a name, then sync_weights()"
            )
        return self.sync_weights(placement=placement)
