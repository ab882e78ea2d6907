"""SamplingClient: generation from one sampler (a base model, a pinned weight
version, or a model's latest weights)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import grpc

from treadle import _convert
from treadle._rpc import error_from_rpc
from treadle.errors import InvalidArgumentError
from treadle.futures import APIFuture
from treadle.types import ModelInput, SampleResponse, SamplingParams, StreamedSample
from treadle.v1 import sampling_pb2

if TYPE_CHECKING:
    from treadle.service_client import ServiceClient


class SamplingClient:
    """Created by ``ServiceClient.create_sampling_client`` or ``TrainingClient.sync_weights``.

    The sampler may still be in creation (after ``sync_weights``); calls made
    meanwhile are sent once it exists, so they always see the synced weights.
    """

    def __init__(self, service: ServiceClient, info: Future[_convert.SamplerRef]) -> None:
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
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> APIFuture[SampleResponse]:
        """``num_samples`` completions of ``prompt``. ``include_prompt_logprobs``:
        the response's ``prompt_logprobs`` scores every prompt token (None for the
        first), ``log_softmax(logits / T)`` at the request's temperature, the same
        quantity as ``forward_logprobs``; ``topk_prompt_logprobs``: the k most
        likely tokens at each prompt position, as ``(token, logprob)`` pairs."""
        request = self._sample_request(prompt, num_samples, sampling_params)
        request.prompt_logprobs = include_prompt_logprobs
        request.topk_prompt_logprobs = topk_prompt_logprobs
        with self._lock:
            request.seq_id = next(self._seq)
        return self._send(self._service._sampling.Sample, request, retry=True)

    async def sample_async(
        self,
        prompt: ModelInput | Sequence[int],
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> SampleResponse:
        return await self.sample(
            prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs
        )

    def compute_logprobs(self, prompt: ModelInput | Sequence[int]) -> APIFuture[list[float | None]]:
        """The logprob of every prompt token under this sampler's weights at
        temperature 1 (None for the first token, which nothing precedes), from one
        prefill; the tinker SDK's name."""
        params = SamplingParams(max_tokens=1)
        future = self.sample(prompt, 1, params, include_prompt_logprobs=True)
        return future.then(lambda r: list(r.prompt_logprobs or []))

    async def compute_logprobs_async(
        self, prompt: ModelInput | Sequence[int]
    ) -> list[float | None]:
        return await self.compute_logprobs(prompt)

    def resume(
        self,
        resume_handles: Sequence[str],
        sampling_params: SamplingParams | None = None,
    ) -> APIFuture[SampleResponse]:
        """Continue partial rollouts (Kimi k1.5): the ``resume_handle`` of
        sequences that stopped with "partial" (a ``token_budget``). Each is
        re-prefilled from its prompt and tokens so far and sampled on under the
        weights this sampler reads now; it comes back whole (earlier tokens,
        logprobs and version spans first), in the order of the handles, maybe
        "partial" again with a new handle. ``max_tokens`` counts the whole
        sequence. Each handle resumes once, through a sampler of the same
        model; unknown, consumed or foreign handles raise NotFoundError. Not
        retried (a retry could find its handles consumed)."""
        handles = list(resume_handles)
        if not handles:
            raise InvalidArgumentError("resume_handles: give at least one")
        params = sampling_params or SamplingParams()
        request = _convert.resume_request(handles, params)
        return self._send(self._service._sampling.Resume, request, retry=False)

    def _send(self, method: Any, request: Any, *, retry: bool) -> APIFuture[SampleResponse]:
        """Send ``request`` once the sampler exists (with its id); its response."""
        info = self._info
        if info.done() and not info.cancelled() and info.exception() is None:
            # the sampler exists (every call after the first): send now, and hand
            # back the call's own future rather than one chained to it
            request.sampler_id = info.result().sampler_id
            return APIFuture(
                self._service._caller.call(
                    method, request, _convert.sample_response_from_wire, retry=retry
                )
            )
        out: Future[SampleResponse] = Future()

        def send(info: Future[_convert.SamplerRef]) -> None:
            if out.done():
                return
            exc = info.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            request.sampler_id = info.result().sampler_id
            inner = self._service._caller.call(
                method, request, _convert.sample_response_from_wire, retry=retry
            )
            _chain(inner, out)

        self._info.add_done_callback(send)
        return APIFuture(out)

    # ---- streamed rollouts ----------------------------------------------------------

    def sample_stream_sync(
        self,
        prompt: ModelInput | Sequence[int],
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
    ) -> SampleStream:
        """Start a streamed request now; iterate it for each sample the moment it
        finishes (short answers first), as ``StreamedSample(index, sequence)``;
        every index arrives once. ``close()`` (or leaving a ``with`` block)
        cancels the samples still generating. Not retried: a stream that fails
        raises its error while iterating."""
        request = self._sample_request(prompt, num_samples, sampling_params)
        request.sampler_id = self._info.result().sampler_id
        caller = self._service._caller
        call = self._service._sampling.SampleStream(
            request, timeout=caller.timeout_s, metadata=caller.call_metadata()
        )
        return SampleStream(call)

    async def sample_stream(
        self,
        prompt: ModelInput | Sequence[int],
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
    ) -> AsyncIterator[StreamedSample]:
        """``sample_stream_sync`` as an async iterator (``async for s in ...``); the
        stream is read on a helper thread, so the event loop never blocks.
        ``aclose()`` (or leaving the loop) cancels the samples still generating."""
        request = self._sample_request(prompt, num_samples, sampling_params)
        request.sampler_id = (await asyncio.wrap_future(self._info)).sampler_id
        caller = self._service._caller
        call = self._service._sampling.SampleStream(
            request, timeout=caller.timeout_s, metadata=caller.call_metadata()
        )
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[StreamedSample | BaseException | None] = asyncio.Queue()

        def put(item: StreamedSample | BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens
                loop.call_soon_threadsafe(items.put_nowait, item)

        def pump() -> None:
            try:
                for msg in call:
                    put(_convert.streamed_sample_from_wire(msg))
                put(None)
            except grpc.RpcError as err:
                put(error_from_rpc(err))
            except Exception as err:  # a conversion bug: surface it, do not hang
                put(err)

        threading.Thread(target=pump, name="treadle-sample-stream", daemon=True).start()
        try:
            while True:
                item = await items.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            call.cancel()

    def _sample_request(
        self,
        prompt: ModelInput | Sequence[int],
        num_samples: int,
        sampling_params: SamplingParams | None,
    ) -> sampling_pb2.SampleRequest:
        if not isinstance(prompt, ModelInput):
            prompt = ModelInput.from_ints(prompt)
        if num_samples < 1:
            raise InvalidArgumentError("num_samples: must be at least 1")
        params = sampling_params or SamplingParams()
        return _convert.sample_request(prompt, num_samples, params)


class SampleStream:
    """A streamed sampling request in progress (``SamplingClient.sample_stream_sync``)."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[StreamedSample]:
        return self

    def __next__(self) -> StreamedSample:
        try:
            return _convert.streamed_sample_from_wire(next(self._call))
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED and self._call.cancelled():
                raise StopIteration from None  # closed by us
            raise error_from_rpc(err) from None

    def close(self) -> None:
        """Cancel the samples still generating (nothing happens once all arrived)."""
        self._call.cancel()

    def __enter__(self) -> SampleStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


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
