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
   first token is drawn from the one set of prompt logits (the rows of every
   request finishing in one prefill forward in one choice and one device read).
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

Around the step, one module each: ``sampler_validation`` (what a request must
satisfy), ``fair_queue`` (the order requests are admitted in), ``prefix_cache``
(the staging slots and prefix reuse), ``prepack_policy`` (when decode runs on
prepacked weights; the CPU only), ``partials`` (partial rollouts and their
resumption), ``token_choice`` (tokens chosen on the device, one read per step),
``memory_budget`` (the KV cache sized by free memory), ``step_window`` (rates),
and ``sampler_forward`` (the prefill and decode forwards themselves).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor

from treadle.common.engine.domain import SampleOp, SampleResult
from treadle.common.engine.stats import SamplerStats
from treadle.errors import ResourceExhaustedError, TreadleError
from treadle.workers.device import memory_budget
from treadle.workers.device.device import upload
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model.llama import lm_logits
from treadle.workers.sampler import forward
from treadle.workers.sampler.backend import ResumeJob, SampleJob
from treadle.workers.sampler.fair_queue import FairQueue
from treadle.workers.sampler.partials import PartialStore, gather, resume_op
from treadle.workers.sampler.prefix_cache import PrefixCache
from treadle.workers.sampler.prepack_policy import PrepackPolicy
from treadle.workers.sampler.sampling import requests_row_keys
from treadle.workers.sampler.state import (
    Partial,
    Row,
    SamplerLimits,
    TorchRequest,
    compact,
    lora_for,
    prefill_batches,
    sequence_of,
    swap_weights,
)
from treadle.workers.sampler.step_window import StepWindow, log_stats
from treadle.workers.sampler.token_choice import choose, record, to_host
from treadle.workers.sampler.validation import validate
from treadle.workers.trainer.prompt_logprobs import PromptScorer

log = logging.getLogger("treadle.sampler")

__all__ = ["SamplerLimits", "SamplerStats", "TorchSampler"]


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
        #: where the cache, the step's inputs and the sampling live: the weights' device
        self.device = base.device
        self.cache, stage = memory_budget.sampler_caches(base, lim, self.max_len)
        self.prefix = PrefixCache(stage, kept_slots=lim.turn_cache_slots)
        self.queue = FairQueue()
        self.prefilling: list[TorchRequest] = []
        self.running: list[Row] = []  # running[i].slot == i
        self.reserved = 0  # main slots promised to prefilling requests
        self.partials = PartialStore()
        self.packing = PrepackPolicy(lim.prepack, self.cache.num_slots)
        tok_path = base.path / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_path)) if tok_path.exists() else None
        self.eos_ids = frozenset(self.cfg.eos_token_ids)
        # metrics
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.prefix_reused_tokens = 0
        self.decode_steps = 0
        self._clock = 0
        self._window = StepWindow()
        self._last_log = time.monotonic()

    # ---- admission -----------------------------------------------------------------

    def validate(self, op: SampleOp) -> None:
        """INVALID_ARGUMENT naming the field, unless this sampler can run ``op``."""
        validate(
            op,
            vocab_size=self.cfg.vocab_size,
            max_len=self.max_len,
            num_slots=self.cache.num_slots,
            has_tokenizer=self.tokenizer is not None,
        )

    def submit(
        self, job: SampleJob, future: Future[SampleResult], *, prefix: Partial | None = None
    ) -> None:
        """Queue ``job`` (validated first); RESOURCE_EXHAUSTED when the queue is full.

        ``job.latest_of``: the model whose latest weights the request follows (an
        in-flight update, ``swap_weights``, reaches it). ``job.on_sequence``: called
        with (sample index, sequence, engine seconds since its previous call) the
        moment each row finishes (not for cancelled rows). ``job.owner``: who may
        resume its partial rows; ``prefix``: the partial rollout it continues.
        The queue is fair across tenants (``workers.sampler.fair_queue``).
        """
        op = job.op
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
        request = TorchRequest(
            job,
            future,
            stop_ids,
            seed,
            prompt,
            prefix=prefix,
            scorer=PromptScorer(op) if op.scores_prompt else None,
        )
        if op.params.max_tokens == 0:
            request.rows = [
                Row(request, i, -1, 0, job.weights, stop_reason="length")
                for i in range(op.num_samples)
            ]
            self._report(request.rows)
            self._finish_request(request)
            return
        self.queue.push(request)

    def resume(self, job: ResumeJob, future: Future[SampleResult]) -> None:
        """Continue partial rollouts (``job.handles``, consumed) under ``job.weights``:
        each is re-prefilled from its prompt and tokens so far, then sampled on with
        ``job.params`` (``max_tokens`` counts the whole sequence). ``future`` gets the
        sequences whole, earlier parts first. Refused as a whole (nothing
        consumed) when a handle is unknown or another owner's (NOT_FOUND), a
        ``max_tokens`` leaves no room, or the queue is full."""
        handles = job.handles
        kept = self.partials.take(job.owner, handles)
        ops: list[SampleOp] = []
        try:
            for handle, part in zip(handles, kept, strict=True):
                op = resume_op(handle, part, job.params)
                self.validate(op)
                ops.append(op)
            if len(self.queue) + len(ops) > self.limits.max_queued:
                raise ResourceExhaustedError(
                    f"sampler: too many requests queued for {self.base.name}; retry later",
                    retry_after_s=1.0,
                )
        except TreadleError:
            self.partials.give_back(handles, kept)  # refused: nothing consumed
            raise
        parts: list[Future[SampleResult]] = [Future() for _ in ops]
        gather(parts, future, resumed=sum(len(p.tokens) for p in kept))
        for op, part, sub in zip(ops, kept, parts, strict=True):
            self.submit(SampleJob(job.base, op, job.weights, job.target), sub, prefix=part)

    def swap_weights(self, snapshot: WeightSnapshot) -> int:
        """An in-flight weight update (PipelineRL): ``sampler_state.swap_weights``;
        the running rows switched."""
        return swap_weights(self.running, self.prefilling, self.queue, snapshot)

    def has_work(self) -> bool:
        return bool(self.queue or self.prefilling or self.running)

    def step_work(self) -> tuple[str, int]:
        """What the next ``step`` is about to compute, for its thread count
        (``workers.device.thread_choice``): ``("prefill", tokens)`` when it prefills
        (the rows decoding count too), else ``("decode", rows)``. An estimate: the
        queue's prompts count as one step's budget."""
        pending = sum(r.prompt.size - r.prefilled for r in self.prefilling)
        if self.queue:
            pending += self.limits.max_prefill_tokens
        budget = self.limits.max_prefill_tokens * (1 if self.running else 4)
        prefill = min(pending, budget)
        return ("prefill" if prefill else "decode"), len(self.running) + prefill

    def stats(self) -> SamplerStats:
        window = self._window
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
            tokens_per_s=window.tokens_per_s(),
            occupancy=window.occupancy(self.cache.num_slots),
            base_model=self.base.name,
            dtype=str(self.base.dtype).removeprefix("torch."),
            last_step_at=window.last_step_at(),
        )

    def fail_all(self, error: TreadleError) -> None:
        """Fail every queued and running request with ``error`` and free everything."""
        requests = {id(r.request): r.request for r in self.running}
        requests.update({id(r): r for r in self.prefilling})
        requests.update({id(r): r for r in self.queue})
        for req in requests.values():
            if not req.future.done():
                req.future.set_exception(error)
        # The main cache's invariant (``kv_cache``): a step that failed part way
        # wrote at most one position past a row's, and a starting request its prompt.
        reach = [r.position + 1 for r in self.running] + [r.prompt.size for r in self.prefilling]
        self.cache.clear(range(self.cache.num_slots), max(reach, default=0))
        self.running.clear()
        for req in self.prefilling:
            self.prefix.forget(req)
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
        self.queue.drop_cancelled()
        for req in [r for r in self.prefilling if r.cancelled]:
            self.prefix.release(req)
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
            request = self.queue.peek()
            need = request.op.num_samples
            if len(self.running) + self.reserved + need > self.cache.num_slots:
                return
            if self.prefix.slot_for(request, self._clock) < 0:
                return
            self.queue.pop()
            self.prefix_reused_tokens += request.reused
            self.reserved += need
            self.prefilling.append(request)

    # ---- prefill -----------------------------------------------------------------------

    def _prefill(self, budget: int) -> int:
        """One chunk of prompt tokens for the prefilling requests; the tokens used."""
        chunks: list[tuple[TorchRequest, int]] = []
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

    def _prefill_forward(self, batch: list[tuple[TorchRequest, int]]) -> None:
        self.prefix.writing(batch)
        hidden_B_T_H = forward.prefill(
            self.cfg, self.prefix.stage, batch, self.max_len, self.device
        )
        params = batch[0][0].snapshot.params
        finished: list[tuple[TorchRequest, Tensor]] = []
        for b, (req, n) in enumerate(batch):
            req.prefilled += n
            self.prompt_tokens += n
            self.prefix.advanced(req, self._clock)
            if req.prefilled == req.prompt.size:
                finished.append((req, hidden_B_T_H[b, n - 1]))
        if finished:
            hidden_F_H = torch.stack([h for _, h in finished])
            head_lora = lora_for([req.snapshot.adapter for req, _ in finished])
            logits_F_V = lm_logits(self.cfg, params, hidden_F_H, lora=head_lora)
            self._start_rows([req for req, _ in finished], logits_F_V)

    def _start_rows(self, requests: Sequence[TorchRequest], logits_F_V: Tensor) -> None:
        """The prompts are in: copy each one's KV to its G consecutive main slots, then
        draw every row's first token from its prompt's logits (``logits_F_V[f]`` for
        ``requests[f]``), all rows in one choice and one device read."""
        counts = [r.op.num_samples for r in requests]
        self.cache.copy_from(
            self.prefix.stage,
            [r.stage_slot for r in requests],
            counts,
            len(self.running),
            max(r.prompt.size for r in requests),
        )
        keys = requests_row_keys([r.seed for r in requests], counts)
        rows: list[Row] = []
        prompt_of: list[int] = []  # each row's index into logits_F_V
        for f, (request, G) in enumerate(zip(requests, counts, strict=True)):
            P, first = request.prompt.size, len(self.running)
            self.prefix.release(request)
            self.reserved -= G
            snap = request.snapshot
            request.rows = [
                Row(request, i, first + i, keys[f][i], snap, position=P) for i in range(G)
            ]
            self.running.extend(request.rows)
            rows.extend(request.rows)
            prompt_of.extend([f] * G)
        index_B = upload(torch.tensor(prompt_of), logits_F_V.device)
        self._emit(rows, logits_F_V.index_select(0, index_B))
        for request in requests:
            if request.swap_to is not None:
                for row in request.rows:
                    row.snapshot = request.swap_to
                request.swap_to = None
        if any(r.stop_reason for r in rows):
            self._compact()

    # ---- decode ------------------------------------------------------------------------

    def _decode(self) -> None:
        """Every running row advances one token: a forward per set of base weights,
        each sampled on the device, then one read of all their tokens (``token_choice``)."""
        chosen = forward.decode(self.cfg, self.cache, self.packing, self.running, self.device)
        tokens_N, logprobs_N = to_host([c[1] for c in chosen], [c[2] for c in chosen])
        done = 0
        for rows, _, _ in chosen:
            n = len(rows)
            record(rows, tokens_N[done : done + n], logprobs_N[done : done + n], *self._recorders)
            done += n
        self.tokens_generated += done
        self.decode_steps += 1
        self._window.record(self.tokens_generated, len(self.running))
        self._compact()

    # ---- choosing tokens -----------------------------------------------------------------

    @property
    def _recorders(self) -> tuple[PartialStore, Tokenizer | None]:
        return self.partials, self.tokenizer

    def _emit(self, rows: Sequence[Row], logits_B_V: Tensor) -> None:
        """Choose one token per row, record it, and mark rows that stop."""
        tokens_B, logprobs_B = choose(rows, logits_B_V)
        tokens, logprobs = to_host([tokens_B], [logprobs_B])
        record(rows, tokens, logprobs, *self._recorders)
        self.tokens_generated += len(rows)

    def _compact(self) -> None:
        """Drop finished rows (``sampler_state.compact``) and resolve what they end."""
        if all(r.stop_reason is None for r in self.running):
            return
        finished = [r for r in self.running if r.stop_reason is not None]
        self.prefix.keep_completion(finished, self.cache, self._clock)  # before slots move
        self.running, done = compact(self.running, self.cache)
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

    def _finish_request(self, request: TorchRequest) -> None:
        if request.future.done():
            return
        sequences = tuple(sequence_of(r) for r in request.rows)
        prompt = request.scorer.result() if request.scorer is not None else None
        request.future.set_result(
            SampleResult(sequences, compute_s=request.compute_s, prompt=prompt)
        )

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= self.limits.log_every_s:
            self._last_log = now
            log_stats(self.stats())
