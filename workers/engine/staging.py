"""An engine in front of a checkpoint store: the engine reads and writes local
directories only; this moves checkpoints between a local staging directory and
the store (S3) on I/O threads, never on the engine thread.

What is staged is declared by each call (``messages``: ``fetches``, ``uploads``)
or, for an ordered call, by its op (``domain``), never by a method here:

- an upload (``SaveStateOp``, ``UnloadModelCall``, ``ExportCall``): the engine
  writes into a fresh staging directory; once it has applied the call, the
  directory is uploaded and only then does the call resolve;
- a fetch (``LoadStateOp``, ``CreateModelCall.from_state``, a saved state as a
  ``ForwardLogprobs`` reference): the files are downloaded first, then handed to
  the engine. Later calls of the model may arrive meanwhile: the engine's
  scheduler holds them until this ``seq_id`` lands.
- Auto-checkpoints (after an ``OptimStepOp``): moved aside on the engine thread
  the moment the step resolves (so the next one cannot overwrite them mid-upload),
  then uploaded; the result names the storage path.

With a local store every path is already a local directory and calls go straight
to the engine (the embedded hot path pays nothing).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from treadle.common.engine.api import OnSequence
from treadle.common.engine.domain import ModelStatus, OpResult, OptimStepResult, SaveResult
from treadle.common.engine.messages import EngineCall, SampleStreamCall, StreamEnd, SubmitCall
from treadle.common.futures import outcome_of, settle
from treadle.errors import InternalError, TreadleError, UnavailableError
from treadle.workers.engine.loop import Engine

if TYPE_CHECKING:
    from treadle.common.store import Store

log = logging.getLogger("treadle.engine")
T = TypeVar("T")
R = TypeVar("R")


class StagedEngine:
    """``EngineAPI`` over an ``Engine``, with storage paths in: each call's storage
    paths, as the call (or its op) declares them (``fetches``, ``uploads``), are
    staged around it; a call that declares none goes straight through."""

    def __init__(self, engine: Engine, store: Store, io_threads: int = 4) -> None:
        self.engine = engine
        self.store = store
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="treadle-store")
        #: (model_id, seq_id) -> the staged copy of an applied save whose upload
        #: failed: a repeat of that call uploads it (the engine does not write again)
        self._unsent: dict[tuple[str, int], Path] = {}
        self._unsent_lock = threading.Lock()

    def stop(self) -> None:
        self.engine.stop()
        self._io.shutdown(wait=False, cancel_futures=True)

    def stream(self, call: SampleStreamCall, on_sequence: OnSequence) -> Future[StreamEnd]:
        return self.engine.stream(call, on_sequence)

    def model_status(self, model_id: str) -> ModelStatus:
        return self.engine.model_status(model_id)

    def has_model(self, model_id: str) -> bool:
        return self.engine.has_model(model_id)

    def call(self, call: EngineCall[R]) -> Future[R]:
        if self.store.is_local:  # storage paths are the engine's own directories
            return self.engine.call(call)
        # an ordered call stages what its op declares, the rest what the call does
        holder: Any = call.op if isinstance(call, SubmitCall) else call
        key = (call.model_id, call.seq_id) if isinstance(call, SubmitCall) else None
        fetch = _declared(holder, holder.fetches)
        upload = _declared(holder, holder.uploads)
        out: Future[Any] = Future()
        if fetch:
            field, path = fetch[0]

            def fetched(local: Path) -> None:
                local_call = _with(call, holder, field, str(local))
                inner = self.engine.call(local_call)
                self._chain(inner, out, after=lambda _: self.store.release(local, path))

            self._on_io(lambda: self.store.fetch(path), out, fetched)
        elif upload:
            field, path = upload[0]
            with self._unsent_lock:
                kept = self._unsent.pop(key, None) if key is not None else None
            staged = kept or self.store.staging_dir(path)
            inner = self.engine.call(_with(call, holder, field, str(staged)))
            self._chain(inner, out, upload=lambda r: self._upload(r, staged, path, key))
        elif isinstance(call, SubmitCall):  # an auto-checkpoint may follow an optim step
            inner = self.engine.call(call)
            inner.add_done_callback(lambda f: self._after_step(f, out))
        else:  # nothing to stage: the engine's own future (a cancel reaches the engine)
            return self.engine.call(call)
        return out

    # ---- plumbing ------------------------------------------------------------------------

    def _upload(
        self, result: Any, staged: Path, path: str, key: tuple[str, int] | None = None
    ) -> Any:
        if not staged.exists():  # a repeat of an applied save: an earlier call uploaded it
            self.store.release(staged, path)
            try:
                manifest = self.store.read_manifest(path)
            except TreadleError as err:
                raise UnavailableError(
                    f"store: the state was saved but never uploaded to {path}, and its staged "
                    f"copy is gone; save it again ({err.message})"
                ) from None
            step = getattr(result, "step", None)
            if step is not None and manifest.get("step", step) != step:
                raise UnavailableError(
                    f"store: {path} holds step {manifest.get('step')}, not the step {step} "
                    "saved and never uploaded; save it again"
                )
            return result
        try:
            size = self.store.commit(staged, path)
        except Exception:
            if key is not None:  # kept for a repeat of the call (same seq_id) to upload
                with self._unsent_lock:
                    self._unsent[key] = staged
            else:
                self.store.release(staged, path)
            raise
        return replace(result, size_bytes=size) if isinstance(result, SaveResult) else result

    def _after_step(self, inner: Future[OpResult], out: Future[OpResult]) -> None:
        """Runs on the engine thread as the call resolves: an auto-checkpoint is moved
        aside before the engine can start the next call, then uploaded."""
        if inner.exception() is not None:
            settle(out, inner.exception())
            return
        result = inner.result()
        auto = result.auto_checkpoint if isinstance(result, OptimStepResult) else None
        if auto is None or auto.directory.startswith("s3://"):
            settle(out, result)
            return
        local = Path(auto.directory)
        try:
            parts = local.relative_to(self.store.local_root).parts  # <tenant>/<model>/auto
            path = self.store.state_path(*parts)
            moved = self.store.staging_dir(path)
            local.rename(moved)
        except Exception as err:
            log.error("auto-checkpoint %s: %s", local, err)
            settle(out, InternalError(f"auto-checkpoint: {err}"))
            return

        def upload() -> OpResult:
            try:
                self.store.commit(moved, path)
            except Exception:
                self.store.release(moved, path)
                raise
            return replace(result, auto_checkpoint=replace(auto, directory=path))

        self._on_io(upload, out, lambda r: settle(out, r))

    def _chain(
        self,
        inner: Future[Any],
        out: Future[Any],
        *,
        after: Callable[[Future[Any]], None] | None = None,
        upload: Callable[[Any], Any] | None = None,
    ) -> None:
        def done(f: Future[Any]) -> None:
            if after is not None:
                self._io.submit(after, f)
            err = f.exception()
            if err is not None or upload is None:
                settle(out, err if err is not None else f.result())
                return
            self._on_io(lambda: upload(f.result()), out, lambda r: settle(out, r))

        inner.add_done_callback(done)

    def _on_io(self, fn: Callable[[], T], out: Future[Any], then: Callable[[T], None]) -> None:
        def run() -> None:
            value = outcome_of(fn, "store", log)
            if isinstance(value, TreadleError):
                settle(out, value)
                return
            then(value)

        self._io.submit(run)


def _get(obj: Any, field: str) -> Any:
    for name in field.split("."):
        obj = getattr(obj, name, None) if obj is not None else None
    return obj


def _declared(holder: Any, fields: tuple[str, ...]) -> list[tuple[str, str]]:
    """(field, storage path) of each declared field that holds a path in this call
    (e.g. a ``ForwardLogprobs`` whose reference is a kept version holds none)."""
    return [(f, v) for f in fields if isinstance(v := _get(holder, f), str) and v]


def _set(obj: Any, field: str, value: str) -> Any:
    head, _, rest = field.partition(".")
    return replace(obj, **{head: _set(getattr(obj, head), rest, value) if rest else value})


def _with(call: EngineCall[Any], holder: Any, field: str, local: str) -> EngineCall[Any]:
    """``call`` with the storage path in ``field`` (of the call, or of its op) made
    the local directory ``local``."""
    if holder is call:
        return cast("EngineCall[Any]", _set(call, field, local))
    return replace(cast(SubmitCall, call), op=_set(holder, field, local))
