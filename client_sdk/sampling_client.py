"""SamplingClient: generation from one sampler (a base model, a pinned weight
version, or a model's latest weights)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from treadle import _convert
from treadle.errors import InvalidArgumentError
from treadle.futures import APIFuture
from treadle.types import ModelInput, SampleResponse, SamplingParams
from treadle.v1 import sampling_pb2

if TYPE_CHECKING:
    from treadle.service_client import ServiceClient


class SamplingClient:
    """Created by ``ServiceClient.create_sampling_client`` or ``TrainingClient.sync_weights``.

    The sampler may still be in creation (after ``sync_weights``); calls made
    meanwhile are sent once it exists, so they always see the synced weights.
    """

    def __init__(self, service: ServiceClient, info: Future[sampling_pb2.SamplerInfo]) -> None:
        self._service = service
        self._info = info
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    # ---- identity (blocks until the sampler exists) -----------------------------

    @property
    def sampler_id(self) -> str:
        return self._info.result().sampler_id

    @property
    def model_id(self) -> str | None:
        return self._info.result().model_id or None

    @property
    def version(self) -> int | None:
        """The pinned weight version; None when following ``latest``."""
        info = self._info.result()
        return None if info.follows_latest else info.version

    @property
    def base_model(self) -> str:
        return self._info.result().base_model

    # ---- sampling -----------------------------------------------------------------

    def sample(
        self,
        prompt: ModelInput | Sequence[int],
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
    ) -> APIFuture[SampleResponse]:
        if not isinstance(prompt, ModelInput):
            prompt = ModelInput.from_ints(prompt)
        params = sampling_params or SamplingParams()
        if num_samples < 1:
            raise InvalidArgumentError("num_samples: must be at least 1")
        with self._lock:
            seq_id = next(self._seq)
        request = sampling_pb2.SampleRequest(
            seq_id=seq_id, num_samples=num_samples, params=_convert.sampling_params_to_wire(params)
        )
        _convert.prompt_to_wire(prompt, request.prompt)
        out: Future[SampleResponse] = Future()

        def send(info: Future[sampling_pb2.SamplerInfo]) -> None:
            if out.done():
                return
            exc = info.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            request.sampler_id = info.result().sampler_id
            inner = self._service._caller.call(
                self._service._sampling.Sample, request, _convert.sample_response_from_wire
            )
            _chain(inner, out)

        self._info.add_done_callback(send)
        return APIFuture(out)

    async def sample_async(
        self,
        prompt: ModelInput | Sequence[int],
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
    ) -> SampleResponse:
        return await self.sample(prompt, num_samples, sampling_params)


def _chain(src: Future, dst: Future) -> None:
    def done(f: Future) -> None:
        if dst.done():
            return
        if f.cancelled():
            dst.cancel()
            return
        exc = f.exception()
        if exc is not None:
            dst.set_exception(exc)
        else:
            dst.set_result(f.result())

    src.add_done_callback(done)
    dst.add_done_callback(lambda f: src.cancel() if f.cancelled() else None)
