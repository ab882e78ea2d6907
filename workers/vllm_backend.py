"""The vLLM sampler backend (``--sampler vllm``): one vLLM engine per base model
and dtype, driven through vLLM's public ``LLMEngine`` API on a thread of its own.

How treadle's sampling maps onto vLLM:

* A request of G samples is G vLLM requests of ``n = 1``, each seeded with its
  sample's stream key: vLLM 0.32 fans ``n = G`` out into exactly such child
  requests itself (``v1/engine/parallel_sampling.py``); treadle does it so
  each sample can be cancelled, budgeted and moved to new weights on its own.
  Prefix caching is on, so the group's prompt KV is shared.
* Weights: the base model is vLLM's model; every published LoRA version is a
  vLLM adapter (``workers.vllm_adapters``), new id per version, unloaded once
  released and unused. On the CPU, base-model rows run under an all-zero
  adapter of their own (``AdapterRegistry.base_adapter``: vLLM 0.32's CPU LoRA
  ops would give them the last slot's adapter). Full fine-tunes are refused (FAILED_PRECONDITION): one
  vLLM engine holds one set of base weights, and swapping whole models in and
  out of it per request (``collective_rpc``/weight-transfer API) is not done.
* Every token records the version of the adapter that produced it. An
  in-flight update (``publish(inflight=True)``) aborts the running vLLM
  requests of that model's ``latest`` samplers and re-submits each with its
  prompt and tokens so far under the new adapter: the next token is the new
  version's (a vLLM request's adapter is fixed for its life). Unlike the torch
  backend, the KV of the earlier tokens is recomputed under the new weights.
* ``token_budget`` caps the vLLM request's ``max_tokens``; a sample stopped by
  the budget alone becomes a partial rollout with a resume handle, and
  ``resume`` submits prompt + tokens so far as a new request.
* Cancelling a future aborts its vLLM requests at the next step.
* A vLLM engine that dies (its step raises) fails its running requests with
  UNAVAILABLE and is started again at the next request; nothing of training
  lives in it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treadle.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    TreadleError,
    UnavailableError,
)
from treadle.workers.base_models import BaseModel
from treadle.workers.domain import SampleOp, SampleResult, SequenceResult, version_spans
from treadle.workers.model.config import ModelConfig
from treadle.workers.sampler_backend import (
    EngineThread,
    OnSequence,
    Requester,
    ResumeRequest,
    SampleRequest,
    TensorsCopy,
)
from treadle.workers.sampler_loop import SamplerLoop
from treadle.workers.sampler_state import Partial, SamplerLimits, SamplerStats
from treadle.workers.sampler_validation import validate
from treadle.workers.sampling import row_keys
from treadle.workers.versions import WeightSnapshot
from treadle.workers.vllm_adapters import AdapterRegistry, VllmAdapter
from treadle.workers.vllm_engine import (
    VllmSettings,
    engine_dead,
    on_gpu,
    start_engine,
    wake_if_dead,
)
from treadle.workers.vllm_params import check_supported, sampling_kwargs, stop_reason_of

log = logging.getLogger("treadle.vllm")

#: partial rollouts kept for resumption; beyond it the oldest are forgotten
MAX_PARTIALS = 65536

EngineKey = tuple[str, str]  # (base model name, dtype)


@dataclass
class _Request:
    future: Future[SampleResult]
    stop_ids: frozenset[int]
    params: Any  # SamplingConfig of this call
    requester: Requester
    on_sequence: OnSequence | None
    rows: list[_Row] = field(default_factory=list)
    compute_s: float = 0.0
    reported_s: float = 0.0


@dataclass
class _Row:
    request: _Request
    index: int
    prompt: np.ndarray  # what this call prefilled (a resume: the prompt and earlier tokens)
    max_tokens: int  # this call's cap
    seed: int
    weights: WeightSnapshot
    adapter: VllmAdapter | None
    prefix: Partial | None = None  # the partial rollout it continues
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    vid: str = ""  # its current vLLM request id
    stop_reason: str | None = None
    handle: str = ""


class _Engine:
    """One vLLM engine (started at its first request) and the rows it runs."""

    def __init__(self, base: BaseModel) -> None:
        self.base = base
        self.llm: Any = None
        self.adapters = AdapterRegistry(base.name)
        self.rows: dict[str, _Row] = {}  # vLLM request id -> row
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.prefix_reused_tokens = 0
        self.steps = 0
        self.window: deque[tuple[float, int, int]] = deque()  # (time, tokens, rows)


class VllmBackend:
    """``SamplerBackend`` over vLLM engines, stepped on the backend's own thread."""

    name = "vllm"

    def __init__(self, limits: SamplerLimits, settings: VllmSettings) -> None:
        self.limits = limits
        self.settings = settings
        self._engines: dict[EngineKey, _Engine] = {}
        self._ids = itertools.count()
        self._partials: OrderedDict[str, Partial] = OrderedDict()
        self._partials_lock = threading.Lock()
        self._pending = 0  # requests posted and not finished (queue bound)
        self._pending_lock = threading.Lock()
        self._stats: dict[EngineKey, SamplerStats] = {}
        self._stats_lock = threading.Lock()
        self._loop = SamplerLoop(self._step_all, self._has_work)
        self._closing = threading.Event()
        self._watchdog = threading.Thread(
            target=self._watch, name="treadle-vllm-watch", daemon=True
        )

    # ---- SamplerBackend ------------------------------------------------------------------

    def start(self, engine: EngineThread) -> None:
        self._loop.start()
        self._watchdog.start()

    def close(self, error: TreadleError, timeout: float = 10.0) -> None:
        self._closing.set()
        self._loop.post(lambda: self._fail_everything(error))
        self._loop.post(self._shutdown_engines)
        self._loop.stop(timeout)

    def max_context(self, cfg: ModelConfig) -> int:
        return self.limits.context_of(cfg)

    def copy_weights(self) -> TensorsCopy | None:
        return None

    def submit(self, request: SampleRequest, future: Future[SampleResult]) -> None:
        try:
            self._validate(request.base, request.op)  # first: the torch backend's answers
            self._check(request.base, request.weights, request.op.params)
            self._reserve(1)
        except TreadleError as err:
            future.set_exception(err)
            return
        op = request.op
        seed = op.params.seed
        if seed is None:
            seed = secrets.randbits(63)
        req = self._new_request(future, op.params, request.requester, request.on_sequence)
        prompt = np.ascontiguousarray(op.prompt, dtype=np.int64)
        keys = row_keys(seed, op.num_samples)
        for i in range(op.num_samples):
            req.rows.append(
                _Row(req, i, prompt, op.params.max_tokens, keys[i], request.weights, None)
            )
        self._loop.post(lambda: self._admit(request.base, req))

    def resume(self, request: ResumeRequest, future: Future[SampleResult]) -> None:
        kept: list[Partial] = []
        try:
            kept = self._take_partials(request.requester.owner, request.handles)
            rows_args = []
            for handle, part in zip(request.handles, kept, strict=True):
                done = len(part.tokens)
                if request.params.max_tokens <= done:
                    raise InvalidArgumentError(
                        f"max_tokens: counts the whole sequence, and resume handle "
                        f"{handle[:48]!r} has {done} tokens already; give more than "
                        f"{done} (got {request.params.max_tokens})"
                    )
                prompt = np.concatenate([part.prompt, np.asarray(part.tokens, np.int64)])
                rows_args.append((prompt, request.params.max_tokens - done, part))
                self._validate(request.base, SampleOp(prompt, 1, request.params))
            self._check(request.base, request.weights, request.params)
            self._reserve(1)
        except TreadleError as err:
            if kept:
                self._give_back(request.handles, kept)
            future.set_exception(err)
            return
        seed = request.params.seed
        if seed is None:
            seed = secrets.randbits(63)
        req = self._new_request(future, request.params, request.requester, None)
        keys = row_keys(seed, len(rows_args))
        for i, (prompt, max_tokens, part) in enumerate(rows_args):
            req.rows.append(
                _Row(req, i, prompt, max_tokens, keys[i], request.weights, None, prefix=part)
            )
        self._loop.post(lambda: self._admit(request.base, req))

    def publish(self, base: BaseModel, weights: WeightSnapshot, *, inflight: bool) -> None:
        if inflight and weights.model_id is not None and weights.adapter is not None:
            self._loop.post(lambda: self._swap(base, weights))

    def release(self, model_id: str, versions: Sequence[int]) -> None:
        gone = set(versions)

        def release() -> None:
            for eng in self._engines.values():
                eng.adapters.release(model_id, gone)

        self._loop.post(release)

    def fail_all(self, error: TreadleError) -> None:
        self._loop.post(lambda: self._fail_everything(error))

    def stats(self) -> list[SamplerStats]:
        with self._stats_lock:
            return list(self._stats.values())

    # ---- checks (engine thread) -----------------------------------------------------------

    def _check(self, base: BaseModel, weights: WeightSnapshot, params: Any) -> None:
        if weights.adapter is None and not base.holds(weights.params):
            raise FailedPreconditionError(
                f"sampler: model {weights.model_id} is a full fine-tune; the vllm sampler "
                "backend serves base models and LoRA models only (a vLLM engine holds one "
                "set of base weights); sample it on a worker started with --sampler torch"
            )
        if weights.adapter is not None and weights.adapter.rank > self.settings.max_lora_rank:
            raise InvalidArgumentError(
                f"rank: the model's LoRA rank {weights.adapter.rank} is above the vLLM "
                f"engine's max LoRA rank {self.settings.max_lora_rank} "
                "(--vllm-max-lora-rank)"
            )
        check_supported(params, base.cfg.vocab_size)

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

    def _new_request(
        self, future: Future[SampleResult], params: Any, who: Requester, on: OnSequence | None
    ) -> _Request:
        return _Request(future, frozenset(), params, who, on)

    def _take_partials(self, owner: tuple[str, str], handles: Sequence[str]) -> list[Partial]:
        if not handles:
            raise InvalidArgumentError("resume_handles: give at least one")
        if len(set(handles)) != len(handles):
            raise InvalidArgumentError("resume_handles: a handle is given twice")
        with self._partials_lock:
            for h in handles:
                kept = self._partials.get(h)
                if kept is None or kept.owner != owner:
                    raise NotFoundError(f"resume handle {h[:48]!r} not found")
            return [self._partials.pop(h) for h in handles]

    def _give_back(self, handles: Sequence[str], kept: Sequence[Partial]) -> None:
        with self._partials_lock:
            for h, part in zip(handles, kept, strict=True):
                self._partials[h] = part

    # ---- the loop (backend thread) -----------------------------------------------------------

    def _has_work(self) -> bool:
        return any(e.rows for e in self._engines.values())

    def _engine_for(self, base: BaseModel) -> _Engine:
        key = (base.name, str(base.dtype))
        eng = self._engines.get(key)
        if eng is None:
            eng = self._engines[key] = _Engine(base)
        if eng.llm is None:
            eng.llm = start_engine(
                base,
                self.settings,
                max_len=self.limits.context_of(base.cfg),
                max_seqs=self.limits.num_slots,
            )
        return eng

    def _admit(self, base: BaseModel, req: _Request) -> None:
        if req.future.done():
            self._done(req)
            return
        try:
            eng = self._engine_for(base)
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
                if row.weights.adapter is not None:
                    row.adapter = eng.adapters.adapter_for(
                        row.weights.model_id or "", row.weights.version, row.weights.adapter
                    )
                elif not on_gpu():  # see AdapterRegistry.base_adapter
                    row.adapter = eng.adapters.base_adapter(base.cfg)
                if row.adapter is not None:
                    row.adapter.users += 1
            for row in req.rows:
                if row.max_tokens == 0:
                    row.stop_reason = "length"
                else:
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

    def _send(self, eng: _Engine, row: _Row) -> None:
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

    def _watch(self) -> None:
        """Wake the loop out of a ``step()`` on an engine whose process died."""
        woken: set[int] = set()
        while not self._closing.wait(0.5):
            for eng in list(self._engines.values()):
                llm = eng.llm
                if llm is not None and id(llm) not in woken and wake_if_dead(llm):
                    woken.add(id(llm))

    def _step_all(self) -> None:
        for eng in list(self._engines.values()):
            self._drop_cancelled(eng)
            self._unload(eng)
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
            self._publish_stats(eng)

    def _take(self, eng: _Engine, outputs: list[Any], spent: float) -> None:
        produced = 0
        per_row = spent / max(1, len(outputs))
        for out in outputs:
            row = eng.rows.get(out.request_id)
            if row is None:
                continue  # aborted (cancelled, or moved to new weights)
            comp = out.outputs[0]
            new = list(comp.token_ids)
            lps = comp.logprobs or []
            for j, tok in enumerate(new):
                row.tokens.append(int(tok))
                row.logprobs.append(float(lps[j][tok].logprob) if j < len(lps) else float("nan"))
                row.versions.append(row.weights.version)
            produced += len(new)
            row.request.compute_s += per_row
            if out.finished:
                del eng.rows[out.request_id]
                eng.prompt_tokens += len(out.prompt_token_ids or [])
                eng.prefix_reused_tokens += int(out.num_cached_tokens or 0)
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
                    row.handle = self._keep_partial(row)
                self._row_done(row)
        eng.tokens_generated += produced
        eng.steps += 1
        now = time.monotonic()
        eng.window.append((now, eng.tokens_generated, len(eng.rows)))
        while len(eng.window) > 64 or (eng.window and now - eng.window[0][0] > 10.0):
            eng.window.popleft()

    def _row_done(self, row: _Row) -> None:
        if row.adapter is not None:
            row.adapter.users -= 1
        req = row.request
        if req.on_sequence is not None and not req.future.done():
            spent, req.reported_s = req.compute_s - req.reported_s, req.compute_s
            try:
                req.on_sequence(row.index, _sequence_of(row), spent)
            except Exception:
                log.exception("vllm: on_sequence callback failed")
        self._maybe_finish(req)

    def _maybe_finish(self, req: _Request) -> None:
        if any(r.stop_reason is None for r in req.rows):
            return
        if not req.future.done():
            resumed = sum(len(r.prefix.tokens) for r in req.rows if r.prefix is not None)
            req.future.set_result(
                SampleResult(
                    tuple(_sequence_of(r) for r in req.rows),
                    compute_s=req.compute_s,
                    resumed_tokens=resumed,
                )
            )
        self._done(req)

    def _done(self, req: _Request) -> None:
        with self._pending_lock:
            self._pending -= 1

    def _keep_partial(self, row: _Row) -> str:
        prefix = row.prefix
        kept = Partial(
            owner=row.request.requester.owner,
            prompt=row.prompt if prefix is None else prefix.prompt,
            tokens=(prefix.tokens if prefix else []) + row.tokens,
            logprobs=(prefix.logprobs if prefix else []) + row.logprobs,
            versions=(prefix.versions if prefix else []) + row.versions,
        )
        handle = "rh-" + secrets.token_urlsafe(18)
        with self._partials_lock:
            self._partials[handle] = kept
            while len(self._partials) > MAX_PARTIALS:
                self._partials.popitem(last=False)
        return handle

    def _swap(self, base: BaseModel, weights: WeightSnapshot) -> None:
        """An in-flight update: every running row following ``weights.model_id``'s
        latest continues under ``weights`` from its next token."""
        for eng in self._engines.values():
            moving = [
                r for r in eng.rows.values() if r.request.requester.latest_of == weights.model_id
            ]
            if not moving or weights.adapter is None:
                continue
            new = eng.adapters.adapter_for(weights.model_id or "", weights.version, weights.adapter)
            eng.llm.abort_request([r.vid for r in moving])
            for row in moving:
                del eng.rows[row.vid]
                if row.adapter is not None:
                    row.adapter.users -= 1
                row.weights, row.adapter = weights, new
                new.users += 1
                self._send(eng, row)

    def _drop_cancelled(self, eng: _Engine) -> None:
        gone = [r for r in eng.rows.values() if r.request.future.cancelled()]
        if not gone:
            return
        eng.llm.abort_request([r.vid for r in gone])
        for row in gone:
            del eng.rows[row.vid]
            row.stop_reason = "cancelled"
            if row.adapter is not None:
                row.adapter.users -= 1
            self._maybe_finish(row.request)

    def _unload(self, eng: _Engine) -> None:
        for a in eng.adapters.collectable():
            if eng.llm is not None:
                try:
                    eng.llm.remove_lora(a.lora_id)
                except Exception as err:  # never loaded (no request reached vLLM)
                    log.debug("vllm: remove_lora(%d): %s", a.lora_id, err)

    def _engine_died(self, eng: _Engine, err: Exception) -> None:
        error = UnavailableError(
            f"sampler: the vLLM engine for {eng.base.name} failed ({type(err).__name__}: "
            f"{err}); it restarts at the next request, retry"
        )
        self._fail_engine(eng, error)
        with contextlib.suppress(Exception):
            eng.llm.engine_core.shutdown()
        eng.llm = None
        eng.adapters.close()
        eng.adapters = AdapterRegistry(eng.base.name)

    def _fail_engine(self, eng: _Engine, error: TreadleError) -> None:
        rows = list(eng.rows.values())
        if rows and eng.llm is not None:
            with contextlib.suppress(Exception):
                eng.llm.abort_request([r.vid for r in rows])
        eng.rows.clear()
        for req in {id(r.request): r.request for r in rows}.values():
            self._fail_request(req, error)

    def _fail_request(self, req: _Request, error: TreadleError) -> None:
        for row in req.rows:
            if row.stop_reason is None:
                row.stop_reason = "cancelled"
                if row.adapter is not None:
                    row.adapter.users -= 1
                    row.adapter = None
        if not req.future.done():
            req.future.set_exception(error)
        self._done(req)

    def _fail_everything(self, error: TreadleError) -> None:
        for eng in self._engines.values():
            self._fail_engine(eng, error)

    def _shutdown_engines(self) -> None:
        for eng in self._engines.values():
            if eng.llm is not None:
                try:
                    eng.llm.engine_core.shutdown()
                except Exception:
                    log.exception("vllm: engine shutdown failed")
                eng.llm = None
            eng.adapters.close()

    def _publish_stats(self, eng: _Engine) -> None:
        w = eng.window
        rate = 0.0
        if len(w) > 1 and time.monotonic() - w[-1][0] < 5.0:
            rate = (w[-1][1] - w[0][1]) / max(w[-1][0] - w[0][0], 1e-9)
        slots = self.limits.num_slots
        steps = len(w)
        stats = SamplerStats(
            running_rows=len(eng.rows),
            queued_requests=0,
            prefilling_requests=0,
            free_slots=max(0, slots - len(eng.rows)),
            num_slots=slots,
            tokens_generated=eng.tokens_generated,
            prompt_tokens=eng.prompt_tokens,
            prefix_reused_tokens=eng.prefix_reused_tokens,
            decode_steps=eng.steps,
            tokens_per_s=rate,
            occupancy=sum(min(r, slots) for _, _, r in w) / (steps * slots) if steps else 0.0,
            base_model=eng.base.name,
            dtype=str(eng.base.dtype).removeprefix("torch."),
            last_step_at=w[-1][0] if w else 0.0,
        )
        with self._stats_lock:
            self._stats[(eng.base.name, str(eng.base.dtype))] = stats


def _sequence_of(row: _Row) -> SequenceResult:
    prefix = row.prefix
    tokens = (prefix.tokens if prefix else []) + row.tokens
    logprobs = (prefix.logprobs if prefix else []) + row.logprobs
    versions = (prefix.versions if prefix else []) + row.versions
    return SequenceResult(
        tokens=np.asarray(tokens, dtype=np.int64),
        logprobs=np.asarray(logprobs, dtype=np.float32),
        stop_reason=row.stop_reason or "cancelled",
        versions=version_spans(versions),
        resume_handle=row.handle,
    )


def make_vllm_backend(limits: SamplerLimits, options: dict[str, Any]) -> VllmBackend:
    return VllmBackend(limits, VllmSettings.from_options(dict(options)))
