"""The vLLM sampler backend (``--sampler vllm``): vLLM engines driven through vLLM's
public ``LLMEngine`` API on a thread of the backend's own (docs/backends.md says
how treadle's sampling maps onto vLLM).

* A request of G samples is G vLLM requests of ``n = 1``, each seeded with its
  sample's stream key (vLLM fans ``n = G`` out the same way), so each can be
  cancelled, budgeted and moved to new weights alone; prefix caching shares
  the group's prompt KV.
* Weights (``workers.vllm.pool``): the base model's LoRA engine serves every
  LoRA version as an adapter (``workers.vllm.adapters``), and the base model
  itself on a GPU; on a CPU host the base model's rows run on a plain engine
  without LoRA; a full fine-tune model gets an engine of its own whose versions
  take turns in its weights (``workers.vllm.full``).
* Every token records the version that produced it. An in-flight update aborts
  the running vLLM requests of the model's ``latest`` samplers and re-submits
  each, prompt and tokens so far, under the new weights (a vLLM request's
  adapter is fixed for its life; the earlier tokens' KV is recomputed).
* ``token_budget`` caps a vLLM request's ``max_tokens``; a sample stopped by the
  budget alone becomes a partial rollout (``workers.vllm.rows``) that ``resume``
  submits again as prompt + tokens so far. A vLLM engine that dies fails its
  running requests with UNAVAILABLE and starts again at the next request.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import threading
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from treadle.common.engine.domain import SampleOp, SampleResult
from treadle.common.engine.model_config import ModelConfig
from treadle.common.engine.stats import SamplerStats
from treadle.errors import (
    InvalidArgumentError,
    ResourceExhaustedError,
    TreadleError,
    UnavailableError,
)
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model.params import LlamaParams
from treadle.workers.model.published import WeightsFile, WholeWeights
from treadle.workers.sampler.backend import (
    EngineThread,
    ResumeJob,
    SampleJob,
)
from treadle.workers.sampler.partials import PartialStore
from treadle.workers.sampler.sampling import row_keys
from treadle.workers.sampler.state import Partial, SamplerLimits
from treadle.workers.sampler.thread import SamplerLoop
from treadle.workers.sampler.validation import validate
from treadle.workers.vllm.engine import VllmSettings, engine_dead
from treadle.workers.vllm.full import (
    is_full,
    keep_version,
    remove_orphan_versions,
    version_memory,
)
from treadle.workers.vllm.params import (
    check_prompt_scores,
    check_supported,
    sampling_kwargs,
    stop_reason_of,
)
from treadle.workers.vllm.pool import EnginePool, VllmEngine
from treadle.workers.vllm.rows import VllmRequest, VllmRow, partial_of, sequence_of
from treadle.workers.vllm.stats import StatsBoard

log = logging.getLogger("treadle.vllm")


class VllmBackend:
    """``SamplerBackend`` over vLLM engines, stepped on the backend's own thread."""

    name = "vllm"
    reads_base_weights = False

    def __init__(self, limits: SamplerLimits, settings: VllmSettings) -> None:
        self.limits = limits
        self.settings = settings
        self._pool = EnginePool(limits, settings)
        self._ids = itertools.count()
        self._partials = PartialStore()
        self._pending = 0  # requests posted and not finished (queue bound)
        self._pending_lock = threading.Lock()
        self._stats = StatsBoard()
        self._loop = SamplerLoop(self._step_all, self._has_work)
        self._closing = threading.Event()
        self._watchdog = threading.Thread(
            target=self._pool.watch, args=(self._closing,), name="treadle-vllm-watch", daemon=True
        )

    # ---- SamplerBackend ------------------------------------------------------------------

    def start(self, engine: EngineThread) -> None:
        remove_orphan_versions()  # a killed worker's published versions
        self._loop.start()
        self._watchdog.start()

    def close(self, error: TreadleError, timeout: float = 10.0) -> None:
        self._closing.set()
        self._loop.post(lambda: self._fail_everything(error))
        self._loop.post(self._pool.shutdown)
        self._loop.stop(timeout)

    def max_context(self, cfg: ModelConfig) -> int:
        return self.limits.context_of(cfg)

    def keep_weights(self, weights: WholeWeights) -> LlamaParams | WeightsFile:
        """A file vLLM's weight reload reads when the version's turn comes
        (``workers.vllm.full``), written as the tensors come: none kept here."""
        return keep_version(weights)

    def version_memory(self, device: torch.device) -> torch.device | None:
        """The file's: host RAM in ``/dev/shm``, none where the system's temporary
        directory stands in for it (``workers.vllm.full``); never the GPU's."""
        return version_memory()

    def submit(self, job: SampleJob, future: Future[SampleResult]) -> None:
        try:
            self._validate(job.base, job.op)  # first: the torch backend's answers
            self._check(job.weights, job.op.params, job.base.cfg)
            check_prompt_scores(job.op)
            self._reserve(1)
        except TreadleError as err:
            future.set_exception(err)
            return
        op = job.op
        seed = op.params.seed
        if seed is None:
            seed = secrets.randbits(63)
        req = VllmRequest(future, frozenset(), op.params, job.target, job.on_sequence)
        prompt = np.ascontiguousarray(op.prompt, dtype=np.int64)
        keys = row_keys(seed, op.num_samples)
        for i in range(op.num_samples):
            req.rows.append(
                VllmRow(req, i, prompt, op.params.max_tokens, keys[i], job.weights, None)
            )
        self._loop.post(lambda: self._admit(job.base, req))

    def resume(self, job: ResumeJob, future: Future[SampleResult]) -> None:
        kept: list[Partial] = []
        try:
            kept = self._partials.take(job.owner, job.handles)
            rows_args = []
            for handle, part in zip(job.handles, kept, strict=True):
                done = len(part.tokens)
                if job.params.max_tokens <= done:
                    raise InvalidArgumentError(
                        f"max_tokens: counts the whole sequence, and resume handle "
                        f"{handle[:48]!r} has {done} tokens already; give more than "
                        f"{done} (got {job.params.max_tokens})"
                    )
                prompt = np.concatenate([part.prompt, np.asarray(part.tokens, np.int64)])
                rows_args.append((prompt, job.params.max_tokens - done, part))
                self._validate(job.base, SampleOp(prompt, 1, job.params))
            self._check(job.weights, job.params, job.base.cfg)
            self._reserve(1)
        except TreadleError as err:
            if kept:
                self._partials.give_back(job.handles, kept)
            future.set_exception(err)
            return
        seed = job.params.seed
        if seed is None:
            seed = secrets.randbits(63)
        req = VllmRequest(future, frozenset(), job.params, job.target, None)
        keys = row_keys(seed, len(rows_args))
        for i, (prompt, max_tokens, part) in enumerate(rows_args):
            req.rows.append(
                VllmRow(req, i, prompt, max_tokens, keys[i], job.weights, None, prefix=part)
            )
        self._loop.post(lambda: self._admit(job.base, req))

    def publish(self, base: BaseModel, weights: WeightSnapshot, *, inflight: bool) -> None:
        moves = weights.adapter is not None or is_full(weights, base)
        if inflight and weights.model_id is not None and moves:
            self._loop.post(lambda: self._swap(base, weights))

    def release(self, model_id: str, versions: Sequence[int]) -> None:
        gone = set(versions)

        def release() -> None:
            for eng in self._pool.all():
                eng.adapters.release(model_id, gone)

        self._loop.post(release)

    def fail_all(self, error: TreadleError) -> None:
        self._loop.post(lambda: self._fail_everything(error))

    def training(self) -> None:
        """With ``sleep_during_training`` (GPU hosts): idle engines sleep before the
        round of training passes (``EnginePool.sleep_idle``, on the loop thread)."""
        if self.settings.sleep_during_training:
            self._pool.sleep_idle_from(self._loop.post)

    def stats(self) -> list[SamplerStats]:
        return self._stats.all()

    # ---- checks (caller's thread) ---------------------------------------------------------

    def _check(self, weights: WeightSnapshot, params: Any, cfg: ModelConfig) -> None:
        rank = weights.adapter.rank if weights.adapter is not None else 0
        check_supported(params, cfg.vocab_size, rank, self.settings.max_lora_rank)

    def _validate(self, base: BaseModel, op: SampleOp) -> None:
        validate(
            op,
            vocab_size=base.cfg.vocab_size,
            max_len=self.max_context(base.cfg),
            num_slots=self.limits.num_slots,
            has_tokenizer=(base.path / "tokenizer.json").exists(),
        )

    def _reserve(self, n: int) -> None:
        with self._pending_lock:
            if self._pending + n > self.limits.max_queued:
                raise ResourceExhaustedError(
                    f"sampler: {self._pending} requests already queued; retry later",
                    retry_after_s=1.0,
                )
            self._pending += n

    # ---- the loop (backend thread) -----------------------------------------------------------

    def _has_work(self) -> bool:
        return any(not e.idle() for e in self._pool.all())

    def _admit(self, base: BaseModel, req: VllmRequest) -> None:
        if req.future.done():
            self._done(req)
            return
        weights = req.rows[0].weights
        try:
            eng = self._pool.engine_for(base, weights, self._stats.forget)
        except TreadleError as err:
            self._fail_request(req, err)
            return
        except Exception as err:
            log.error("vllm: the engine for %s did not start: %s", base.name, err)
            self._fail_request(
                req,
                UnavailableError(f"sampler: the vLLM engine for {base.name} did not start: {err}"),
            )
            return
        eos = frozenset() if req.params.ignore_eos else frozenset(base.cfg.eos_token_ids)
        req.stop_ids = eos | frozenset(req.params.stop_token_ids)
        try:
            for row in req.rows:
                if eng.full is not None:
                    pass  # its own engine's weights, no adapter
                elif row.weights.adapter is not None:
                    row.adapter = eng.adapters.adapter_for(
                        row.weights.model_id or "", row.weights.version, row.weights.adapter
                    )
                if row.adapter is not None:
                    row.adapter.users += 1
            for row in req.rows:
                if row.max_tokens == 0:
                    row.stop_reason = "length"
                elif eng.full is None or eng.full.admit(row):
                    self._send(eng, row)
        except TreadleError as err:
            self._fail_request(req, err)
            return
        except Exception as err:
            self._fail_request(
                req, InvalidArgumentError(f"sampler: vLLM refused the request: {err}")
            )
            return
        self._maybe_finish(req)

    def _send(self, eng: VllmEngine, row: VllmRow) -> None:
        """Submit the row's next vLLM request: its prompt and tokens so far, under its
        current weights, for the tokens it has left."""
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind

        params = row.request.params
        left = row.max_tokens - len(row.tokens)
        if params.token_budget:
            left = min(left, params.token_budget - len(row.tokens))
        kw = sampling_kwargs(
            params,
            max_tokens=left,
            seed=row.seed + len(row.tokens),
            stop_ids=row.request.stop_ids,
            detokenize=bool(params.stop_strings),
        )
        sp = SamplingParams(**kw, output_kind=RequestOutputKind.DELTA)
        lora = None
        if row.adapter is not None:
            a = row.adapter
            lora = LoRARequest(a.name, a.lora_id, str(a.path))
        ids = row.prompt.tolist() + row.tokens
        row.vid = f"r{next(self._ids)}"
        eng.rows[row.vid] = row
        eng.llm.add_request(row.vid, {"prompt_token_ids": ids}, sp, lora_request=lora)

    def _step_all(self) -> None:
        for eng in self._pool.all():
            self._drop_cancelled(eng)
            self._unload(eng)
            if eng.full is not None and eng.waiting() and eng.llm is not None:
                try:
                    ready = eng.full.next_rows(eng.llm, len(eng.rows))
                except Exception as err:
                    log.error("vllm: loading %s's weights failed: %s", eng.full.model_id, err)
                    self._engine_died(eng, err)
                    continue
                for row in ready:
                    self._send(eng, row)
            if not eng.rows:
                continue
            if engine_dead(eng.llm):
                self._engine_died(eng, RuntimeError("its process exited"))
                continue
            if not eng.llm.has_unfinished_requests():  # never reached vLLM: do not wait on it
                self._engine_died(eng, RuntimeError("rows without vLLM requests"))
                continue
            t0 = time.perf_counter()
            try:
                outputs = eng.llm.step()
            except Exception as err:
                log.error(
                    "vllm: engine for %s failed: %s\n%s", eng.base.name, err, traceback.format_exc()
                )
                self._engine_died(eng, err)
                continue
            spent = time.perf_counter() - t0
            self._take(eng, outputs, spent)
            self._stats.publish(eng, self.limits.num_slots)

    def _take(self, eng: VllmEngine, outputs: list[Any], spent: float) -> None:
        produced = 0
        per_row = spent / max(1, len(outputs))

        def length(out: Any) -> int:  # rows ending in one step: shorter first (streams)
            return len(getattr(eng.rows.get(out.request_id), "tokens", ())) + len(
                out.outputs[0].token_ids
            )

        for out in sorted(outputs, key=length):
            row = eng.rows.get(out.request_id)
            if row is None:
                continue  # aborted (cancelled, or moved to new weights)
            comp = out.outputs[0]
            new = comp.token_ids
            lps = comp.logprobs or []
            version = row.weights.version
            for j, tok in enumerate(new):
                row.tokens.append(int(tok))
                row.logprobs.append(float(lps[j][tok].logprob) if j < len(lps) else float("nan"))
            row.versions.extend([version] * len(new))
            produced += len(new)
            row.request.compute_s += per_row
            if out.finished:
                del eng.rows[out.request_id]
                # computed vs reused, as the torch sampler counts them (GetServerInfo)
                cached = int(out.num_cached_tokens or 0)
                eng.meter.prompt_tokens += len(out.prompt_token_ids or []) - cached
                eng.meter.prefix_reused_tokens += cached
                p = row.request.params
                row.stop_reason = stop_reason_of(
                    comp.finish_reason,
                    row.tokens[-1] if row.tokens else None,
                    comp.stop_reason,
                    p,
                    reached_max=len(row.tokens) >= row.max_tokens,
                    sampled_this_call=len(row.tokens),
                    budget=p.token_budget,
                )
                if row.stop_reason == "partial":
                    row.handle = self._partials.keep(partial_of(row))
                self._row_done(row)
        eng.meter.stepped(produced, len(eng.rows))

    def _row_done(self, row: VllmRow) -> None:
        row.release_adapter()
        req = row.request
        if req.on_sequence is not None and not req.future.done():
            spent, req.reported_s = req.compute_s - req.reported_s, req.compute_s
            try:
                req.on_sequence(row.index, sequence_of(row), spent)
            except Exception:
                log.exception("vllm: on_sequence callback failed")
        self._maybe_finish(req)

    def _maybe_finish(self, req: VllmRequest) -> None:
        if any(r.stop_reason is None for r in req.rows):
            return
        if not req.future.done():
            resumed = sum(len(r.prefix.tokens) for r in req.rows if r.prefix is not None)
            req.future.set_result(
                SampleResult(
                    tuple(sequence_of(r) for r in req.rows),
                    compute_s=req.compute_s,
                    resumed_tokens=resumed,
                )
            )
        self._done(req)

    def _done(self, req: VllmRequest) -> None:
        with self._pending_lock:
            self._pending -= 1

    def _swap(self, base: BaseModel, weights: WeightSnapshot) -> None:
        """An in-flight update: every row following ``weights.model_id``'s latest
        continues under ``weights`` from its next token (on the engine that samples
        ``weights``: a full fine-tune's v0 may have run on the base engine)."""
        follows = weights.model_id
        moving: list[VllmRow] = []
        for eng in self._pool.all():
            for row in eng.waiting():
                if row.request.target.latest_of == follows:
                    row.weights = weights  # its engine is ``weights``'s too
            rows = [r for r in eng.rows.values() if r.request.target.latest_of == follows]
            if rows:
                eng.llm.abort_request([r.vid for r in rows])
            for row in rows:
                del eng.rows[row.vid]
                row.release_adapter()
                row.weights = weights
            moving += rows
        if not moving:
            return
        try:
            target = self._pool.engine_for(base, weights, self._stats.forget)
            if target.full is not None:
                target.full.requeue(moving)  # sent once its engine holds ``weights``
                return
            new = None
            if weights.adapter is not None:
                new = target.adapters.adapter_for(follows or "", weights.version, weights.adapter)
            for row in moving:
                row.adapter = new
                if new is not None:
                    new.users += 1
                self._send(target, row)
        except Exception as err:
            error = err if isinstance(err, TreadleError) else UnavailableError(str(err))
            for req in {id(r.request): r.request for r in moving}.values():
                self._fail_request(req, error)

    def _drop_cancelled(self, eng: VllmEngine) -> None:
        waiting = [r for r in eng.waiting() if r.request.future.cancelled()]
        gone = [r for r in eng.rows.values() if r.request.future.cancelled()]
        if gone:
            eng.llm.abort_request([r.vid for r in gone])
        if eng.full is not None and waiting:
            eng.full.drop(waiting)
        for row in gone:
            del eng.rows[row.vid]
        for row in gone + waiting:
            row.stop_reason = "cancelled"
            row.release_adapter()
            self._maybe_finish(row.request)

    def _unload(self, eng: VllmEngine) -> None:
        for a in eng.adapters.collectable():
            if eng.llm is not None:
                try:
                    eng.llm.remove_lora(a.lora_id)
                except Exception as err:  # never loaded (no request reached vLLM)
                    log.debug("vllm: remove_lora(%d): %s", a.lora_id, err)

    def _engine_died(self, eng: VllmEngine, err: Exception) -> None:
        error = UnavailableError(
            f"sampler: the vLLM engine for {eng.base.name} failed ({type(err).__name__}: "
            f"{err}); it restarts at the next request, retry"
        )
        self._fail_engine(eng, error)
        eng.close()

    def _fail_engine(self, eng: VllmEngine, error: TreadleError) -> None:
        rows = list(eng.rows.values())
        if rows and eng.llm is not None:
            with contextlib.suppress(Exception):
                eng.llm.abort_request([r.vid for r in rows])
        eng.rows.clear()
        rows += eng.waiting()
        if eng.full is not None:
            eng.full.waiting = []
        for req in {id(r.request): r.request for r in rows}.values():
            self._fail_request(req, error)

    def _fail_request(self, req: VllmRequest, error: TreadleError) -> None:
        for row in req.rows:
            if row.stop_reason is None:
                row.stop_reason = "cancelled"
                row.release_adapter()
        if not req.future.done():
            req.future.set_exception(error)
        self._done(req)

    def _fail_everything(self, error: TreadleError) -> None:
        for eng in self._pool.all():
            self._fail_engine(eng, error)


def make_vllm_backend(limits: SamplerLimits, options: dict[str, Any]) -> VllmBackend:
    # vLLM sizes its own KV cache (gpu_memory_utilization): slots "auto" = 64 sequences
    limits = limits if limits.num_slots else replace(limits, num_slots=64)
    return VllmBackend(limits, VllmSettings.from_options(dict(options)))
