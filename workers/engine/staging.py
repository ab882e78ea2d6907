"""An engine in front of a checkpoint store: the engine reads and writes local
directories only; this moves checkpoints between a local staging directory and
the store (S3) on I/O threads, never on the engine thread.

- ``SaveStateOp``: the engine writes into a fresh staging directory; once it has
  applied the op, the directory is uploaded and only then does the call resolve.
- ``LoadStateOp`` and ``create_model(from_state=...)``: the checkpoint is
  downloaded first, then handed to the engine. Later calls of the model may
  arrive meanwhile: the engine's scheduler holds them until this ``seq_id`` lands.
- Auto-checkpoints (after an ``OptimStepOp``): moved aside on the engine thread
  the moment the step resolves (so the next one cannot overwrite them mid-upload),
  then uploaded; the result names the storage path.

With a local store every path is already a local directory and calls go straight
to the engine (the embedded hot path pays nothing).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from treadle.common.engine.api import OnSequence
from treadle.common.engine.domain import (
    ForwardLogprobsOp,
    LoadStateOp,
    ModelSpec,
    ModelStatus,
    OpResult,
    OptimStepResult,
    OrderedOp,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SaveResult,
    SaveStateOp,
)
from treadle.common.futures import outcome_of, settle
from treadle.errors import InternalError, TreadleError, UnavailableError
from treadle.workers.engine.loop import Engine

if TYPE_CHECKING:
    from treadle.common.store import Store

log = logging.getLogger("treadle.engine")
T = TypeVar("T")


class StagedEngine:
    """``EngineAPI`` (``workers.engine_api``) over an ``Engine``, with storage paths in."""

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

    # ---- pass-through ----------------------------------------------------------------

    def delete_model(self, model_id: str) -> Future[None]:
        return self.engine.delete_model(model_id)

    def sample(
        self,
        target: SamplerTarget,
        op: SampleOp,
        *,
        dedupe_key: tuple[str, int, str] | None = None,
        on_sequence: OnSequence | None = None,
    ) -> Future[SampleResult]:
        return self.engine.sample(target, op, dedupe_key=dedupe_key, on_sequence=on_sequence)

    def resume(
        self, target: SamplerTarget, handles: Sequence[str], params: SamplingConfig
    ) -> Future[SampleResult]:
        return self.engine.resume(target, handles, params)

    def check_sampler_target(self, target: SamplerTarget) -> Future[int]:
        return self.engine.check_sampler_target(target)

    def model_status(self, model_id: str) -> ModelStatus:
        return self.engine.model_status(model_id)

    def has_model(self, model_id: str) -> bool:
        return self.engine.has_model(model_id)

    # ---- staged ------------------------------------------------------------------------

    def create_model(
        self, spec: ModelSpec, *, from_state: str | None = None, next_seq_id: int = 1
    ) -> Future[ModelStatus]:
        if from_state is None or self.store.is_local:
            return self.engine.create_model(spec, from_state=from_state, next_seq_id=next_seq_id)
        out: Future[ModelStatus] = Future()

        def fetched(local: Path) -> None:
            inner = self.engine.create_model(spec, from_state=local, next_seq_id=next_seq_id)
            self._chain(inner, out, after=lambda _: self.store.release(local, from_state))

        self._on_io(lambda: self.store.fetch(from_state), out, fetched)
        return out

    def submit(self, model_id: str, seq_id: int, op: OrderedOp, digest: str) -> Future[OpResult]:
        if self.store.is_local:
            return self.engine.submit(model_id, seq_id, op, digest)
        out: Future[OpResult] = Future()
        if isinstance(op, LoadStateOp):
            path = op.directory

            def fetched(local: Path) -> None:
                inner = self.engine.submit(
                    model_id, seq_id, replace(op, directory=str(local)), digest
                )
                self._chain(inner, out, after=lambda _: self.store.release(local, path))

            self._on_io(lambda: self.store.fetch(path), out, fetched)
        elif isinstance(op, ForwardLogprobsOp) and _state_reference(op):
            ref = op.reference_weights
            assert ref is not None

            def fetched_ref(local: Path) -> None:
                local_ref = replace(ref, directory=str(local))
                inner = self.engine.submit(
                    model_id, seq_id, replace(op, reference_weights=local_ref), digest
                )
                self._chain(inner, out, after=lambda _: self.store.release(local, ref.directory))

            # Each call downloads the state (the engine's cache then skips re-reading
            # it as weights); a local store hands over the directory itself.
            self._on_io(lambda: self.store.fetch(ref.directory), out, fetched_ref)
        elif isinstance(op, SaveStateOp):
            with self._unsent_lock:
                kept = self._unsent.pop((model_id, seq_id), None)
            staged = kept or self.store.staging_dir(op.directory)
            inner = self.engine.submit(model_id, seq_id, replace(op, directory=str(staged)), digest)
            self._chain(
                inner,
                out,
                upload=lambda r: self._upload_save(r, staged, op.directory, (model_id, seq_id)),
            )
        else:
            inner = self.engine.submit(model_id, seq_id, op, digest)
            inner.add_done_callback(lambda f: self._after_step(f, out))
        return out

    def unload_model(self, model_id: str, path: str, *, force: bool = False) -> Future[SaveResult]:
        """Checkpoint an idle model to the storage path ``path``, then free it
        (``force``: whatever it holds, ``Engine.unload_model``)."""
        if self.store.is_local:
            return self.engine.unload_model(model_id, path, force=force)
        out: Future[SaveResult] = Future()
        staged = self.store.staging_dir(path)
        inner = self.engine.unload_model(model_id, staged, force=force)
        self._chain(inner, out, upload=lambda r: self._upload_save(r, staged, path))
        return out

    def export_weights(self, model_id: str, directory: str, *, merged: bool) -> Future[list[str]]:
        """Export into the storage path ``directory`` (files a server then fetches);
        the names."""
        path = directory
        out: Future[list[str]] = Future()
        staged = self.store.staging_dir(path)
        inner = self.engine.export_weights(model_id, staged, merged=merged)

        def upload(names: list[str]) -> list[str]:
            try:
                self.store.commit(staged, path)
            except Exception:
                self.store.release(staged, path)
                raise
            return names

        self._chain(inner, out, upload=upload)
        return out

    # ---- plumbing ------------------------------------------------------------------------

    def _upload_save(
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


def _state_reference(op: ForwardLogprobsOp) -> bool:
    """Whether ``op`` reads a saved state as its reference (a download first)."""
    return op.reference_weights is not None and bool(op.reference_weights.directory)
