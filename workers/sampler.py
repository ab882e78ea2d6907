"""The torch sampler: continuous batching over a preallocated KV cache.

Each sequence being generated is a *row*, living in one slot of the main KV
cache. Running rows always occupy consecutive slots ``0..n-1`` (a row that
finishes leaves a hole, and the last row moves into it), so the decode step's
attention reads the cache in place, with no per-step gather or concatenation.

A ``step()`` does, in order:

1. *Admission and prefill.* Waiting requests enter while the main cache has
   room for their G rows. A request's prompt is prefilled once, into a slot of
   a small *staging* cache, in chunks of at most ``max_prefill_tokens`` per
   step across all prefilling requests, so a long prompt never stalls the
   running batch for more than one chunk. The staging cache doubles as a prefix
   cache: a prompt that starts like a staged one (same weights) copies that KV
   and prefills only the rest. Once the whole prompt is in, its KV is copied
   into the G consecutive main slots of the request's rows, and each row's
   first token is drawn from the one set of prompt logits.
2. *Decode.* Every running row advances one token, in one batched forward per
   base weights (LoRA rows of different adapters and versions share it through
   ``LoraRows``; full fine-tunes have their own base weights). Finished rows
   free their slots at once, and their request resolves when its last row ends.

Sampling: logprob of the chosen token = ``log_softmax(logits / T)`` before any
top-k / top-p truncation (DESIGN.md, "Temperature belongs to the policy").
The choice is inverse-CDF sampling with *one* uniform per row and token, drawn
from a counter-based hash of (request seed, sample index, token index): no
generator state, no ``torch.multinomial``, and a seeded request reproduces its
tokens whatever else shares the batch and whenever it is scheduled.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import secrets
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor

from treadle.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    TreadleError,
)
from treadle.workers.base_models import BaseModel
from treadle.workers.domain import SampleOp, SampleResult, SamplingConfig, SequenceResult
from treadle.workers.model import prepack
from treadle.workers.model.kv_cache import KVCache
from treadle.workers.model.llama import LlamaParams, forward_hidden, lm_logits
from treadle.workers.sample_checks import check_sample_op
from treadle.workers.sampler_state import (
    Partial,
    Request,
    Row,
    SamplerLimits,
    SamplerStats,
    Staged,
    charge,
    common_prefix,
    lora_for,
    prefill_batches,
    sequence_of,
    start_tag,
)
from treadle.workers.sampling import row_keys, row_uniforms, sample_tokens
from treadle.workers.versions import WeightSnapshot

log = logging.getLogger("treadle.sampler")

__all__ = ["SamplerLimits", "SamplerStats", "TorchSampler"]

#: A queued request waits for one being prefilled when it could then reuse this
#: many more prompt tokens (the wait is at most that request's prefill).
MIN_PREFIX_WAIT = 16
#: partial rollouts kept for resumption per sampler; beyond it the oldest are forgotten
MAX_PARTIALS = 65536
#: weight versions kept prepacked per sampler (each is a second copy of the weights)
MAX_PACKED = 2


class TorchSampler:
    def __init__(
        self,
        base: BaseModel,
        *,
        num_slots: int = 64,
        max_len: int = 1024,
        limits: SamplerLimits | None = None,
    ) -> None:
        lim = limits or SamplerLimits(num_slots=num_slots, max_len=max_len)
        self.limits = lim
        self.base = base
        self.cfg = base.cfg
        self.max_len = lim.context_of(self.cfg)
        try:
            self.cache = KVCache(self.cfg, lim.num_slots, self.max_len, dtype=base.dtype)
            self.stage = KVCache(
                self.cfg, max(1, lim.prefill_slots), self.max_len, dtype=base.dtype
            )
        except (RuntimeError, MemoryError) as err:
            raise ResourceExhaustedError(
                f"sampler: cannot allocate the KV cache ({lim.num_slots} slots x "
                f"{self.max_len} tokens): {err}"
            ) from None
        self.staged = [Staged() for _ in range(self.stage.num_slots)]
        self.queue: deque[Request] = deque()  # in start-tag order (fair across tenants)
        self._vtime = 0.0  # start tag of the request admitted last
        self._finish_tags: dict[str, float] = {}  # tenant -> finish tag of its last request
        self.prefilling: list[Request] = []
        self.running: list[Row] = []  # running[i].slot == i
        self.reserved = 0  # main slots promised to prefilling requests
        self.partials: OrderedDict[str, Partial] = OrderedDict()  # resume handle -> rollout
        self._packed: OrderedDict[int, weakref.ref[LlamaParams]] = OrderedDict()  # prepacked
        self._pack_method: str | None = None  # prepack.method_for the decode width
        self._pack_min_rows = 0  # prepack.min_rows: smaller decode batches run plain
        self._pack_after = 0  # prepack.pack_after: decode steps before weights are packed
        self._decoded: dict[int, tuple[weakref.ref[LlamaParams], int]] = {}
        tok_path = base.path / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_path)) if tok_path.exists() else None
        self.eos_ids = frozenset(self.cfg.eos_token_ids)
        # metrics
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.prefix_reused_tokens = 0
        self.decode_steps = 0
        self._clock = 0
        self._window: deque[tuple[float, int, int]] = deque()  # (time, tokens, rows)
        self._last_log = time.monotonic()

    # ---- admission -----------------------------------------------------------------

    def validate(self, op: SampleOp) -> None:
        check_sample_op(
            op,
            self.cfg,
            max_len=self.max_len,
            max_samples=self.cache.num_slots,
            has_tokenizer=self.tokenizer is not None,
        )

    def submit(
        self,
        op: SampleOp,
        snapshot: WeightSnapshot,
        future: Future[SampleResult],
        tenant: str = "",
        *,
        latest_of: str | None = None,
        on_sequence: Callable[[int, SequenceResult, float], None] | None = None,
        owner: tuple[str, str] = ("", ""),
        prefix: Partial | None = None,
    ) -> None:
        """Queue a request (validated first); RESOURCE_EXHAUSTED when the queue is full.

        ``latest_of``: the model whose latest weights the request follows (an
        in-flight update, ``swap_weights``, reaches it). ``on_sequence``: called
        with (sample index, sequence, engine seconds since its previous call) the
        moment each row finishes (not for cancelled rows). ``owner``: who may
        resume its partial rows; ``prefix``: the partial rollout it continues.

        The queue is fair across tenants, never first-come-first-served between
        them: start-time fair queueing by tokens (Goyal et al.). A request's start
        tag is the later of the last admitted tag and its tenant's previous finish
        tag; its finish tag adds its tokens (prompt + samples x max_tokens). Requests
        are admitted in start-tag order, so a tenant with 100 queued requests and
        one with 1 take turns, and each tenant's own requests keep their order.
        """
        self.validate(op)
        if len(self.queue) >= self.limits.max_queued:
            raise ResourceExhaustedError(
                f"sampler: {len(self.queue)} requests already queued for {self.base.name}; "
                "retry later",
                retry_after_s=1.0,
            )
        eos = frozenset() if op.params.ignore_eos else self.eos_ids
        stop_ids = eos | frozenset(op.params.stop_token_ids)
        seed = op.params.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        prompt = np.ascontiguousarray(op.prompt, dtype=np.int64)
        request = Request(
            op,
            snapshot,
            future,
            stop_ids,
            seed,
            prompt,
            tenant=tenant,
            latest_of=latest_of,
            on_sequence=on_sequence,
            owner=owner,
            prefix=prefix,
        )
        if op.params.max_tokens == 0:
            request.rows = [
                Row(request, i, -1, 0, snapshot, stop_reason="length")
                for i in range(op.num_samples)
            ]
            self._report(request.rows)
            self._finish_request(request)
            return
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        cost = request.prompt.size + request.op.num_samples * request.op.params.max_tokens
        start = max(self._vtime, self._finish_tags.get(request.tenant, 0.0))
        self._finish_tags[request.tenant] = start + cost
        if len(self._finish_tags) > 1024:  # forget tenants with nothing queued ahead
            self._finish_tags = {t: f for t, f in self._finish_tags.items() if f > self._vtime}
        request.tag = start
        self.queue.insert(bisect.bisect_right(self.queue, start, key=start_tag), request)

    def take_partials(self, owner: tuple[str, str], handles: Sequence[str]) -> list[Partial]:
        """The partial rollouts of ``handles``, removed (each resumes once).

        All or nothing: a handle that never existed, was consumed (or forgotten,
        beyond ``MAX_PARTIALS``), or belongs to another tenant or model is
        NOT_FOUND, with the same message, and then no handle is consumed.
        """
        if not handles:
            raise InvalidArgumentError("resume_handles: give at least one")
        if len(set(handles)) != len(handles):
            raise InvalidArgumentError("resume_handles: a handle is given twice")
        for h in handles:
            kept = self.partials.get(h)
            if kept is None or kept.owner != owner:
                raise NotFoundError(f"resume handle {h[:48]!r} not found")
        return [self.partials.pop(h) for h in handles]

    def give_back_partials(self, handles: Sequence[str], partials: Sequence[Partial]) -> None:
        """Undo ``take_partials`` (the resume was refused before it started)."""
        for h, kept in zip(handles, partials, strict=True):
            self.partials[h] = kept

    def resume(
        self,
        handles: Sequence[str],
        params: SamplingConfig,
        snapshot: WeightSnapshot,
        future: Future[SampleResult],
        *,
        tenant: str = "",
        latest_of: str | None = None,
        owner: tuple[str, str] = ("", ""),
    ) -> None:
        """Continue partial rollouts (``handles``, consumed) under ``snapshot``: each
        is re-prefilled from its prompt and tokens so far, then sampled on with
        ``params`` (``max_tokens`` counts the whole sequence). ``future`` gets the
        sequences whole, earlier parts first. Refused as a whole (nothing
        consumed) when a handle is unknown or another owner's (NOT_FOUND), a
        ``max_tokens`` leaves no room, or the queue is full."""
        kept = self.take_partials(owner, handles)
        ops: list[SampleOp] = []
        try:
            for handle, part in zip(handles, kept, strict=True):
                done = len(part.tokens)
                if params.max_tokens <= done:
                    raise InvalidArgumentError(
                        f"max_tokens: counts the whole sequence, and resume handle "
                        f"{handle[:48]!r} has {done} tokens already; give more than "
                        f"{done} (got {params.max_tokens})"
                    )
                prompt = np.concatenate([part.prompt, np.asarray(part.tokens, np.int64)])
                op = SampleOp(prompt, 1, replace(params, max_tokens=params.max_tokens - done))
                self.validate(op)
                ops.append(op)
            if len(self.queue) + len(ops) > self.limits.max_queued:
                raise ResourceExhaustedError(
                    f"sampler: too many requests queued for {self.base.name}; retry later",
                    retry_after_s=1.0,
                )
        except TreadleError:
            self.give_back_partials(handles, kept)  # refused: nothing consumed
            raise
        parts: list[Future[SampleResult]] = [Future() for _ in ops]
        _gather(parts, future, resumed=sum(len(p.tokens) for p in kept))
        for op, part, sub in zip(ops, kept, parts, strict=True):
            self.submit(op, snapshot, sub, tenant, latest_of=latest_of, owner=owner, prefix=part)

    def _keep_partial(self, row: Row) -> str:
        prefix = row.request.prefix
        kept = Partial(
            owner=row.request.owner,
            prompt=row.request.prompt if prefix is None else prefix.prompt,
            tokens=(prefix.tokens if prefix else []) + row.tokens,
            logprobs=(prefix.logprobs if prefix else []) + row.logprobs,
            versions=(prefix.versions if prefix else []) + row.versions,
        )
        handle = "rh-" + secrets.token_urlsafe(18)
        self.partials[handle] = kept
        while len(self.partials) > MAX_PARTIALS:  # the oldest are forgotten
            self.partials.popitem(last=False)
        return handle

    def swap_weights(self, snapshot: WeightSnapshot) -> int:
        """An in-flight weight update (PipelineRL): every request following the
        latest weights of ``snapshot.model_id`` continues under ``snapshot``.

        Running rows decode their next token with it (their KV cache, computed
        under the old weights, is kept); requests still prefilling take it after
        their first token; queued ones prefill with it. Returns the running rows
        switched.
        """
        model_id = snapshot.model_id
        switched = 0
        for row in self.running:
            if row.request.latest_of == model_id and row.stop_reason is None:
                row.snapshot = snapshot
                switched += 1
        for req in self.prefilling:
            if req.latest_of == model_id:
                req.swap_to = snapshot
        for req in self.queue:
            if req.latest_of == model_id:
                req.snapshot = snapshot
        return switched

    def has_work(self) -> bool:
        return bool(self.queue or self.prefilling or self.running)

    def stats(self) -> SamplerStats:
        window = self._window
        rows = sum(r for _, _, r in window)
        steps = len(window)
        rate = 0.0
        if steps > 1 and time.monotonic() - window[-1][0] < 5.0:
            rate = (window[-1][1] - window[0][1]) / max(window[-1][0] - window[0][0], 1e-9)
        return SamplerStats(
            running_rows=len(self.running),
            queued_requests=len(self.queue),
            prefilling_requests=len(self.prefilling),
            free_slots=self.cache.num_slots - len(self.running) - self.reserved,
            num_slots=self.cache.num_slots,
            tokens_generated=self.tokens_generated,
            prompt_tokens=self.prompt_tokens,
            prefix_reused_tokens=self.prefix_reused_tokens,
            decode_steps=self.decode_steps,
            tokens_per_s=rate,
            occupancy=rows / (steps * self.cache.num_slots) if steps else 0.0,
            base_model=self.base.name,
            dtype=str(self.base.dtype).removeprefix("torch."),
            last_step_at=window[-1][0] if window else 0.0,
        )

    def fail_all(self, error: TreadleError) -> None:
        """Fail every queued and running request with ``error`` and free everything."""
        requests = {id(r.request): r.request for r in self.running}
        requests.update({id(r): r for r in self.prefilling})
        requests.update({id(r): r for r in self.queue})
        for req in requests.values():
            if not req.future.done():
                req.future.set_exception(error)
        self.running.clear()
        for req in self.prefilling:
            self.staged[req.stage_slot] = Staged()
        self.prefilling.clear()
        self.queue.clear()
        self.reserved = 0

    # ---- the step --------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        self._clock += 1
        self._drop_cancelled()
        # Prefill within a token budget; with no row decoding nobody waits on it, so
        # it may take more (a batch of requests arriving at once starts full).
        budget = self.limits.max_prefill_tokens * (1 if self.running else 4)
        while budget > 0:
            self._admit()
            used = self._prefill(budget) if self.prefilling else 0
            if used == 0:
                break
            budget -= used
        if self.running:
            self._decode()
        self._maybe_log()

    def _drop_cancelled(self) -> None:
        if any(r.cancelled for r in self.queue):
            self.queue = deque(r for r in self.queue if not r.cancelled)
        for req in [r for r in self.prefilling if r.cancelled]:
            self._release_stage(req)
            self.prefilling.remove(req)
            self.reserved -= req.op.num_samples
        gone = [r for r in self.running if r.request.cancelled]
        for row in gone:
            row.stop_reason = "cancelled"
        if gone:
            self._compact()

    def _admit(self) -> None:
        """Move queued requests into prefill while their rows fit in the main cache."""
        while self.queue:
            request = self.queue[0]
            need = request.op.num_samples
            if len(self.running) + self.reserved + need > self.cache.num_slots:
                return
            slot = self._stage_slot_for(request)
            if slot < 0:
                return
            self.queue.popleft()
            self._vtime = max(self._vtime, request.tag)
            self.reserved += need
            self.prefilling.append(request)

    def _stage_slot_for(self, request: Request) -> int:
        """A free staging slot for ``request``, seeded with the longest cached prefix."""
        free = [i for i, s in enumerate(self.staged) if s.owner is None]
        if not free:
            return -1
        prompt = request.prompt
        best, best_len = -1, 0
        for i, staged in enumerate(self.staged):
            n = min(staged.tokens.size, prompt.size)
            if n <= best_len or not staged.computed_by(request.snapshot):
                continue
            common = common_prefix(staged.tokens[:n], prompt[:n])
            if common > best_len:
                best, best_len = i, common
        for staged in self.staged:
            # A request with the same prompt is being prefilled right now (G samples
            # sent as separate requests): wait for it, then copy instead of recompute.
            owner = staged.owner
            if owner is not None and staged.computed_by(request.snapshot):
                n = min(owner.prompt.size, prompt.size)
                if common_prefix(owner.prompt[:n], prompt[:n]) >= best_len + MIN_PREFIX_WAIT:
                    return -1
        if best >= 0 and self.staged[best].owner is None:
            slot = best
        else:
            slot = min(free, key=lambda i: self.staged[i].last_used)
            if best >= 0:
                self.stage.move([best], [slot], best_len)
        # The last prompt token is always computed: its logits choose the first token.
        reuse = min(best_len, prompt.size - 1)
        snap = request.snapshot
        self.staged[slot] = Staged(
            tokens=prompt[:reuse].copy(),
            params=weakref.ref(snap.params),
            adapter=None if snap.adapter is None else weakref.ref(snap.adapter),
            owner=request,
            last_used=self._clock,
        )
        request.stage_slot, request.prefilled, request.reused = slot, reuse, reuse
        self.prefix_reused_tokens += reuse
        return slot

    def _release_stage(self, request: Request) -> None:
        staged = self.staged[request.stage_slot]
        staged.owner = None
        staged.tokens = request.prompt[: request.prefilled].copy()

    # ---- prefill -----------------------------------------------------------------------

    def _prefill(self, budget: int) -> int:
        """One chunk of prompt tokens for the prefilling requests; the tokens used."""
        chunks: list[tuple[Request, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.prompt.size - req.prefilled, budget)
            chunks.append((req, n))
            budget -= n
        for batch in prefill_batches(chunks):
            self._prefill_forward(batch)
        done = [r for r in self.prefilling if r.prefilled == r.prompt.size]
        for req in done:
            self.prefilling.remove(req)
        return sum(n for _, n in chunks)

    def _prefill_forward(self, batch: list[tuple[Request, int]]) -> None:
        B, T = len(batch), max(n for _, n in batch)
        tokens_B_T = torch.zeros(B, T, dtype=torch.long)
        positions_B_T = torch.full((B, T), self.max_len - 1, dtype=torch.long)
        for b, (req, n) in enumerate(batch):
            start = req.prefilled
            tokens_B_T[b, :n] = torch.from_numpy(req.prompt[start : start + n])
            positions_B_T[b, :n] = torch.arange(start, start + n)
        snaps = [req.snapshot for req, _ in batch]
        t0 = time.perf_counter()
        hidden_B_T_H = forward_hidden(
            self.cfg,
            snaps[0].params,
            tokens_B_T,
            positions_B_T,
            lora=lora_for([s.adapter for s in snaps]),
            cache=self.stage,
            slots_B=torch.tensor([req.stage_slot for req, _ in batch]),
        )
        charge(batch, time.perf_counter() - t0)
        finished: list[tuple[Request, Tensor]] = []
        for b, (req, n) in enumerate(batch):
            req.prefilled += n
            self.prompt_tokens += n
            staged = self.staged[req.stage_slot]
            staged.tokens = req.prompt[: req.prefilled].copy()
            staged.last_used = self._clock
            if req.prefilled == req.prompt.size:
                finished.append((req, hidden_B_T_H[b, n - 1]))
        if finished:
            hidden_F_H = torch.stack([h for _, h in finished])
            head_lora = lora_for([req.snapshot.adapter for req, _ in finished])
            logits_F_V = lm_logits(self.cfg, snaps[0].params, hidden_F_H, lora=head_lora)
            for (req, _), logits_V in zip(finished, logits_F_V, strict=True):
                self._start_rows(req, logits_V)

    def _start_rows(self, request: Request, logits_V: Tensor) -> None:
        """The prompt is in: copy its KV to G consecutive main slots and draw first tokens."""
        G, P = request.op.num_samples, request.prompt.size
        first = len(self.running)
        self.cache.copy_from(self.stage, request.stage_slot, first, G, P)
        self._release_stage(request)
        self.reserved -= G
        keys = row_keys(request.seed, G)
        snap = request.snapshot
        rows = [Row(request, i, first + i, keys[i], snap, position=P) for i in range(G)]
        request.rows = rows
        self.running.extend(rows)
        self._emit(rows, logits_V.expand(G, -1))
        if request.swap_to is not None:
            for row in rows:
                row.snapshot = request.swap_to
            request.swap_to = None
        if any(r.stop_reason for r in rows):
            self._compact()

    # ---- decode ------------------------------------------------------------------------

    def _decode(self) -> None:
        groups: dict[int, list[Row]] = {}
        for row in self.running:
            groups.setdefault(id(row.snapshot.params), []).append(row)
        for rows in groups.values():
            params = rows[0].snapshot.params
            tokens = [r.next_input for r in rows]
            positions = [r.position for r in rows]
            slots = [r.slot for r in rows]
            adapters = [r.snapshot.adapter for r in rows]
            pad = self._pad_rows(params, len(rows))
            if pad:
                # Filler rows in free slots at position 0 (overwritten before any
                # real row reads them), so the batch has the packed width.
                free = len(self.running)
                tokens += [0] * pad
                positions += [0] * pad
                slots += range(free, free + pad)
                adapters += [adapters[0]] * pad
            t0 = time.perf_counter()
            packed = prepack.decoding() if self._packs_for(len(rows)) else contextlib.nullcontext()
            with packed:
                lora = lora_for(adapters)
                hidden_B_1_H = forward_hidden(
                    self.cfg,
                    params,
                    torch.tensor(tokens)[:, None],
                    torch.tensor(positions)[:, None],
                    lora=lora,
                    cache=self.cache,
                    slots_B=torch.tensor(slots),
                )
                logits_B_V = lm_logits(self.cfg, params, hidden_B_1_H[:, -1], lora=lora)
                logits_B_V = logits_B_V[: len(rows)]
            for r in rows:
                r.position += 1
            charge([(r.request, 1) for r in rows], time.perf_counter() - t0)
            self._emit(rows, logits_B_V)
        self.decode_steps += 1
        self._window.append((time.monotonic(), self.tokens_generated, len(self.running)))
        while len(self._window) > 64:
            self._window.popleft()
        self._compact()

    def _pad_rows(self, params: LlamaParams, rows: int) -> int:
        """Prepack ``params`` for a decode batch of ``rows`` rows when it pays, and
        return the filler rows to add (``workers.model.prepack``). oneDNN's packed
        weights serve any batch up to the slot count: no filler. MKL's serve only
        the slot count: filler up to it when the batch is at most 1/8 short
        (filler rows cost every other op of the step, the packed matmuls save
        ~20-30% of theirs) and is every running row (so the free slots are the
        filler's); else the plain product, no filler."""
        width = self.cache.num_slots
        if self._pack_method is None:  # one base model and dtype: decided once
            on = self.limits.prepack and prepack.available(params)
            self._pack_method = prepack.method_for(params, width) if on else "plain"
            self._pack_min_rows = prepack.min_rows(params, width) if on else width
            self._pack_after = prepack.pack_after(params, width) if on else 0
        if self._pack_method == "plain":  # off, or measured: no packed copy is faster
            return 0
        if prepack.packed_rows(params) is None and self._steps_with(params) < self._pack_after:
            return 0  # not (yet) worth packing: these weights may not last
        if self._pack_method == "onednn":
            if rows >= self._pack_min_rows:
                self._ensure_packed(params, width)
            return 0
        if rows < width - width // 8 or rows != len(self.running):
            return 0
        self._ensure_packed(params, width)
        return width - rows

    def _steps_with(self, params: LlamaParams) -> int:
        """Decode steps taken with ``params`` so far, this one included."""
        key = id(params)
        known = self._decoded.get(key)
        steps = 1 if known is None or known[0]() is not params else known[1] + 1
        self._decoded[key] = (weakref.ref(params), steps)
        if len(self._decoded) > 64:  # forget weights that are gone
            self._decoded = {k: v for k, v in self._decoded.items() if v[0]() is not None}
        return steps

    def _packs_for(self, rows: int) -> bool:
        """Whether a decode batch of ``rows`` real rows multiplies with packed copies
        (below oneDNN's measured crossover the plain product is faster)."""
        return self._pack_method != "onednn" or rows >= self._pack_min_rows

    def _ensure_packed(self, params: LlamaParams, width: int) -> None:
        """``params`` packed for ``width`` rows; the last ``MAX_PACKED`` weights
        decoded stay packed, older ones are unpacked."""
        key = id(params)
        known = self._packed.pop(key, None)
        if known is None or known() is not params:
            while len(self._packed) >= MAX_PACKED:
                oldest = self._packed.popitem(last=False)[1]()
                if oldest is not None:
                    prepack.unpack(oldest)
        if prepack.packed_rows(params) != width:
            prepack.prepack(params, width)
        self._packed[key] = weakref.ref(params)  # the newest

    # ---- choosing tokens -----------------------------------------------------------------

    def _emit(self, rows: Sequence[Row], logits_B_V: Tensor) -> None:
        """Choose one token per row, record it, and mark rows that stop."""
        params = [r.request.op.params for r in rows]
        uniforms_B = row_uniforms(
            np.array([r.key for r in rows], dtype=np.uint64),
            np.array([len(r.tokens) for r in rows], dtype=np.uint64),
        )
        tokens_B, logprobs_B = sample_tokens(
            logits_B_V,
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            uniforms_B,
        )
        for row, p, tok, lp in zip(
            rows, params, tokens_B.tolist(), logprobs_B.tolist(), strict=True
        ):
            row.tokens.append(tok)
            row.logprobs.append(lp)
            row.versions.append(row.snapshot.version)
            row.next_input = tok
            if tok in row.request.stop_ids:  # EOS (unless ignore_eos) or a stop token id
                row.stop_reason = "stop_token" if tok in p.stop_token_ids else "stop"
            elif p.stop_strings and self._hit_stop_string(row):
                row.stop_reason = "stop_string"
            elif len(row.tokens) >= p.max_tokens:
                row.stop_reason = "length"
            elif p.token_budget and len(row.tokens) >= p.token_budget:
                row.stop_reason = "partial"
                row.handle = self._keep_partial(row)
        self.tokens_generated += len(rows)

    def _hit_stop_string(self, row: Row) -> bool:
        stops = row.request.op.params.stop_strings
        if self.tokenizer is None:
            return False
        longest = max(len(s) for s in stops)
        tail = self.tokenizer.decode(row.tokens[-(longest + 1) :], skip_special_tokens=False)
        return any(s in tail for s in stops)

    def _compact(self) -> None:
        """Drop finished rows; move rows from the end into the holes they leave.

        Keeps ``running[i].slot == i``: the next decode reads slots ``0..n-1``
        in place. One batched copy moves every displaced row.
        """
        if all(r.stop_reason is None for r in self.running):
            return
        done = [r for r in self.running if r.stop_reason is not None]
        live = [r for r in self.running if r.stop_reason is None]
        n = len(live)
        holes = sorted(r.slot for r in done if r.slot < n)
        movers = [r for r in live if r.slot >= n]
        if movers:
            length = max(r.position for r in movers)
            self.cache.move([r.slot for r in movers], holes, length)
            for r, hole in zip(movers, holes, strict=True):
                r.slot = hole
        live.sort(key=lambda r: r.slot)
        self.running = live
        self._report(done)
        for req in {id(r.request): r.request for r in done}.values():
            if all(r.stop_reason is not None for r in req.rows):
                self._finish_request(req)

    def _report(self, rows: Sequence[Row]) -> None:
        """Hand finished rows to their request's ``on_sequence`` (streamed rollouts)."""
        for row in rows:
            req = row.request
            if req.on_sequence is None or row.stop_reason == "cancelled" or req.cancelled:
                continue
            spent, req.reported_s = req.compute_s - req.reported_s, req.compute_s
            try:
                req.on_sequence(row.index, sequence_of(row), spent)
            except Exception:  # a consumer's bug must not stop the sampler
                log.exception("sampler: on_sequence callback failed")

    def _finish_request(self, request: Request) -> None:
        if request.future.done():
            return
        sequences = tuple(sequence_of(r) for r in request.rows)
        request.future.set_result(SampleResult(sequences, compute_s=request.compute_s))

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.limits.log_every_s:
            return
        self._last_log = now
        s = self.stats()
        log.info(
            "sampler %s: %.1f tok/s, %d/%d slots decoding (occupancy %.0f%%), "
            "%d prefilling, %d queued, %d tokens generated, %d prefix tokens reused",
            self.base.name,
            s.tokens_per_s,
            s.running_rows,
            s.num_slots,
            100 * s.occupancy,
            s.prefilling_requests,
            s.queued_requests,
            s.tokens_generated,
            s.prefix_reused_tokens,
        )


def _gather(parts: list[Future[SampleResult]], out: Future[SampleResult], resumed: int) -> None:
    """Resolve ``out`` with the one sequence of each part, in order; cancelling
    ``out`` cancels the parts."""

    def done(_: Future[SampleResult]) -> None:
        if out.done():
            return
        for part in parts:
            if part.done() and not part.cancelled() and part.exception() is not None:
                for other in parts:
                    other.cancel()
                out.set_exception(part.exception())  # type: ignore[arg-type]
                return
        if all(p.done() and not p.cancelled() for p in parts):
            results = [p.result() for p in parts]
            out.set_result(
                SampleResult(
                    tuple(r.sequences[0] for r in results),
                    compute_s=sum(r.compute_s for r in results),
                    resumed_tokens=resumed,
                )
            )

    for part in parts:
        part.add_done_callback(done)
    out.add_done_callback(lambda f: [p.cancel() for p in parts] if f.cancelled() else None)
