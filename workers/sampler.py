"""The torch sampler: continuous batching over a preallocated KV cache.

Each sequence being generated is a *row* living in one cache slot. Every
``step()`` admits waiting requests while slots are free (prefilling a prompt
once and sharing its KV with the request's G rows), then advances every running
row by one token in one batched forward pass; a finished row frees its slot at
once, so the batch never waits for its longest member.

Rows of different adapters or weight versions share a decode batch (their base
matmuls are shared, each row's low-rank update is its own, ``LoraRows``); rows
whose *base* weights differ (full fine-tunes) run as separate groups.

Sampling: logprob of the chosen token = ``log_softmax(logits / T)`` before any
top-k / top-p truncation (DESIGN.md, "Temperature belongs to the policy").
Choice by the exponential race (``argmax(log p - log E)``, E ~ Exp(1)), with
noise drawn from each row's own generator, so a seeded request reproduces its
tokens whatever else shares the batch; no ``torch.multinomial``.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor

from treadle.errors import InvalidArgumentError
from treadle.workers.base_models import BaseModel
from treadle.workers.domain import SampleOp, SampleResult, SequenceResult, version_spans
from treadle.workers.model.kv_cache import KVCache
from treadle.workers.model.llama import forward_hidden, lm_logits
from treadle.workers.model.lora import LoraAdapter, LoraRows
from treadle.workers.versions import WeightSnapshot

log = logging.getLogger("treadle.sampler")

MAX_STOP_STRING_CHARS = 256


@dataclass
class _Request:
    op: SampleOp
    snapshot: WeightSnapshot
    future: Future[SampleResult]
    stop_ids: frozenset[int]
    rows: list[_Row] = field(default_factory=list)

    @property
    def cancelled(self) -> bool:
        return self.future.cancelled()


@dataclass
class _Row:
    request: _Request
    index: int
    slot: int
    snapshot: WeightSnapshot
    generator: torch.Generator
    position: int = 0  # tokens whose K/V are in the cache
    next_input: int = 0  # the last sampled token, fed at the next decode step
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop_reason: str | None = None


@dataclass(frozen=True)
class SamplerStats:
    running_rows: int
    queued_requests: int
    free_slots: int
    tokens_generated: int


class TorchSampler:
    def __init__(self, base: BaseModel, *, num_slots: int = 64, max_len: int = 1024) -> None:
        self.base = base
        self.cfg = base.cfg
        self.max_len = min(max_len, self.cfg.max_position_embeddings)
        self.cache = KVCache(self.cfg, num_slots, self.max_len, dtype=base.dtype)
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self.queue: deque[_Request] = deque()
        self.running: list[_Row] = []
        self.tokens_generated = 0
        tok_path = base.path / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_path)) if tok_path.exists() else None
        self.eos_ids = frozenset(self.cfg.eos_token_ids)

    # ---- admission -----------------------------------------------------------------

    def validate(self, op: SampleOp) -> None:
        p = op.params
        prompt = op.prompt
        if prompt.ndim != 1 or prompt.size == 0:
            raise InvalidArgumentError("prompt: must be a non-empty 1-D token sequence")
        bad = (prompt < 0) | (prompt >= self.cfg.vocab_size)
        if bad.any():
            raise InvalidArgumentError(
                f"prompt: token id {int(prompt[bad][0])} is outside the vocabulary [0, {self.cfg.vocab_size})"
            )
        if prompt.size >= self.max_len:
            raise InvalidArgumentError(
                f"prompt: {prompt.size} tokens leave no room in the context of {self.max_len}"
            )
        if not 1 <= op.num_samples <= self.cache.num_slots:
            raise InvalidArgumentError(
                f"num_samples: must be in 1..{self.cache.num_slots}, got {op.num_samples}"
            )
        if p.max_tokens < 0:
            raise InvalidArgumentError(f"max_tokens: must be >= 0, got {p.max_tokens}")
        if prompt.size + p.max_tokens > self.max_len:
            raise InvalidArgumentError(
                f"max_tokens: prompt ({prompt.size}) + max_tokens ({p.max_tokens}) exceeds the context of {self.max_len}"
            )
        if not (math.isfinite(p.temperature) and p.temperature >= 0):
            raise InvalidArgumentError(f"temperature: must be >= 0, got {p.temperature}")
        if not (0 < p.top_p <= 1):
            raise InvalidArgumentError(f"top_p: must be in (0, 1], got {p.top_p}")
        if p.top_k < -1:
            raise InvalidArgumentError(f"top_k: must be -1 (off) or >= 0, got {p.top_k}")
        for s in p.stop_strings:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidArgumentError(
                    f"stop: stop strings must have 1..{MAX_STOP_STRING_CHARS} characters"
                )
        if p.stop_strings and self.tokenizer is None:
            raise InvalidArgumentError(
                "stop: this base model has no tokenizer.json; use stop token ids"
            )
        for t in p.stop_token_ids:
            if not 0 <= t < self.cfg.vocab_size:
                raise InvalidArgumentError(f"stop: stop token id {t} is outside the vocabulary")

    def submit(self, op: SampleOp, snapshot: WeightSnapshot, future: Future[SampleResult]) -> None:
        self.validate(op)
        stop_ids = self.eos_ids | frozenset(op.params.stop_token_ids)
        self.queue.append(_Request(op, snapshot, future, stop_ids))

    def has_work(self) -> bool:
        return bool(self.queue or self.running)

    def stats(self) -> SamplerStats:
        return SamplerStats(
            len(self.running), len(self.queue), len(self.free_slots), self.tokens_generated
        )

    # ---- the step --------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        self._drop_cancelled()
        self._admit()
        if self.running:
            self._decode()

    def _drop_cancelled(self) -> None:
        self.queue = deque(r for r in self.queue if not r.cancelled)
        for row in [r for r in self.running if r.request.cancelled]:
            self._free(row)

    def _admit(self) -> None:
        while self.queue and len(self.free_slots) >= self.queue[0].op.num_samples:
            request = self.queue.popleft()
            self._prefill(request)

    def _prefill(self, request: _Request) -> None:
        op = request.op
        slots = [self.free_slots.pop() for _ in range(op.num_samples)]
        seed = (
            op.params.seed
            if op.params.seed is not None
            else int.from_bytes(os.urandom(8), "little") >> 1
        )
        for i, slot in enumerate(slots):
            gen = torch.Generator().manual_seed((seed * 1_000_003 + i) % (2**63))
            request.rows.append(
                _Row(request, i, slot, request.snapshot, gen, position=op.prompt.size)
            )
        if op.params.max_tokens == 0:
            for row in request.rows:
                row.stop_reason = "length"
            self._finish_request(request)
            return
        snap = request.snapshot
        tokens_1_P = torch.from_numpy(op.prompt.astype(np.int64))[None, :]
        positions_1_P = torch.arange(op.prompt.size)[None, :]
        hidden = forward_hidden(
            self.cfg,
            snap.params,
            tokens_1_P,
            positions_1_P,
            lora=snap.adapter,
            cache=self.cache,
            slots_B=torch.tensor(slots[:1]),
        )
        if len(slots) > 1:
            self.cache.copy_prefix(slots[0], slots[1:], op.prompt.size)
        logits_1_V = lm_logits(self.cfg, snap.params, hidden[:, -1])
        logits_G_V = logits_1_V.expand(len(slots), -1)
        self._emit(request.rows, logits_G_V)
        self.running.extend(r for r in request.rows if r.stop_reason is None)

    def _decode(self) -> None:
        groups: dict[int, list[_Row]] = {}
        for row in self.running:
            groups.setdefault(id(row.snapshot.params), []).append(row)
        for rows in groups.values():
            params = rows[0].snapshot.params
            tokens_B_1 = torch.tensor([[r.next_input] for r in rows])
            positions_B_1 = torch.tensor([[r.position] for r in rows])
            slots_B = torch.tensor([r.slot for r in rows])
            hidden = forward_hidden(
                self.cfg,
                params,
                tokens_B_1,
                positions_B_1,
                lora=_lora_for(rows),
                cache=self.cache,
                slots_B=slots_B,
            )
            for r in rows:
                r.position += 1
            logits_B_V = lm_logits(self.cfg, params, hidden[:, -1])
            self._emit(rows, logits_B_V)
        self.running = [r for r in self.running if r.stop_reason is None]

    # ---- choosing tokens -----------------------------------------------------------------

    def _emit(self, rows: Sequence[_Row], logits_B_V: Tensor) -> None:
        """Choose one token per row, record it, and finish rows that stop."""
        tokens_B, logprobs_B = sample_tokens(
            logits_B_V.float(),
            [r.request.op.params.temperature for r in rows],
            [r.request.op.params.top_k for r in rows],
            [r.request.op.params.top_p for r in rows],
            [r.generator for r in rows],
        )
        finished: set[int] = set()
        for row, tok, lp in zip(rows, tokens_B.tolist(), logprobs_B.tolist(), strict=True):
            row.tokens.append(tok)
            row.logprobs.append(lp)
            row.versions.append(row.snapshot.version)
            row.next_input = tok
            self.tokens_generated += 1
            params = row.request.op.params
            if tok in row.request.stop_ids or self._hit_stop_string(row):
                row.stop_reason = "stop"
            elif len(row.tokens) >= params.max_tokens:
                row.stop_reason = "length"
            if row.stop_reason is not None:
                self.free_slots.append(row.slot)
                finished.add(id(row.request))
        for row in rows:
            if id(row.request) in finished and all(r.stop_reason for r in row.request.rows):
                finished.discard(id(row.request))
                self._finish_request(row.request)

    def _hit_stop_string(self, row: _Row) -> bool:
        stops = row.request.op.params.stop_strings
        if not stops or self.tokenizer is None:
            return False
        longest = max(len(s) for s in stops)
        tail = self.tokenizer.decode(row.tokens[-(longest + 1) :], skip_special_tokens=False)
        return any(s in tail for s in stops)

    def _free(self, row: _Row) -> None:
        row.stop_reason = row.stop_reason or "cancelled"
        self.free_slots.append(row.slot)
        self.running.remove(row)

    def _finish_request(self, request: _Request) -> None:
        if request.future.done():
            return
        np_dtype = np.float32
        sequences = tuple(
            SequenceResult(
                tokens=np.asarray(r.tokens, dtype=np.int64),
                logprobs=np.asarray(r.logprobs, dtype=np_dtype),
                stop_reason=r.stop_reason or "length",
                versions=version_spans(r.versions),
            )
            for r in request.rows
        )
        request.future.set_result(SampleResult(sequences))


def _lora_for(rows: Sequence[_Row]) -> LoraAdapter | LoraRows | None:
    adapters: list[LoraAdapter] = []
    index: dict[int, int] = {}
    row_ids = []
    for r in rows:
        a = r.snapshot.adapter
        if a is None:
            row_ids.append(-1)
            continue
        if id(a) not in index:
            index[id(a)] = len(adapters)
            adapters.append(a)
        row_ids.append(index[id(a)])
    if not adapters:
        return None
    if len(adapters) == 1 and -1 not in row_ids:
        return adapters[0]
    return LoraRows(adapters, torch.tensor(row_ids))


def sample_tokens(
    logits_B_V: Tensor,
    temperatures: Sequence[float],
    top_ks: Sequence[int],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator],
) -> tuple[Tensor, Tensor]:
    """One token per row and its logprob at the row's temperature (pre-truncation).

    Temperature 0 is greedy; its reported logprob is at temperature 1.
    """
    B, V = logits_B_V.shape
    temps_B = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=logits_B_V.dtype)
    scaled_B_V = logits_B_V / temps_B[:, None]
    logprobs_B_V = torch.log_softmax(scaled_B_V, dim=-1)
    choice_logits = logprobs_B_V
    truncate = [b for b in range(B) if (0 < top_ks[b] < V) or top_ps[b] < 1.0]
    if truncate:
        choice_logits = logprobs_B_V.clone()
        for b in truncate:
            choice_logits[b] = _truncate(logprobs_B_V[b], top_ks[b], top_ps[b])
    noise_B_V = torch.stack(
        [torch.empty(V, dtype=logits_B_V.dtype).exponential_(generator=g) for g in generators]
    )
    tokens_B = (choice_logits - noise_B_V.log()).argmax(-1)
    greedy = [b for b in range(B) if temperatures[b] <= 0]
    if greedy:
        tokens_B[greedy] = logits_B_V[greedy].argmax(-1)
    return tokens_B, logprobs_B_V.gather(-1, tokens_B[:, None]).squeeze(-1)


def _truncate(logprobs_V: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set to -inf every token outside the top-k and outside the top-p nucleus."""
    out = logprobs_V.clone()
    sorted_V, order_V = torch.sort(logprobs_V, descending=True)
    keep_V = torch.ones_like(sorted_V, dtype=torch.bool)
    if 0 < top_k < keep_V.numel():
        keep_V[top_k:] = False
    if top_p < 1.0:
        cum_before_V = torch.cumsum(sorted_V.exp(), 0) - sorted_V.exp()
        keep_V &= cum_before_V < top_p
    keep_V[0] = True
    out[order_V[~keep_V]] = -math.inf
    return out
