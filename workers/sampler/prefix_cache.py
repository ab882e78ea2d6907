"""The torch sampler's staging cache, which doubles as its prefix cache.

A request's prompt is prefilled into a slot of a small *staging* KV cache (in
chunks, ``TorchSampler._prefill``), then copied into the main cache's rows. The
slot keeps the prompt's KV afterwards: a later prompt that starts like a staged
one, under the same weights, copies that KV and prefills only the rest (the G
samples of a group sent as separate requests share one prefill so).

A finished single-sample request that asks for it
(``SamplingConfig.cache_completion``) also leaves its prompt + completion KV
behind (``keep_completion``), in a store of *turns* beside the staging slots:
an agent episode's next turn is the previous turn's prompt + completion + the
environment's observation, so it prefills only the observation (and the
completion's last token, whose KV was never computed). A request that does not
ask costs nothing here (its completion's KV is not copied). The store holds at
most ``kept_slots`` x ``max_len`` tokens (``SamplerLimits.turn_cache_slots``,
which the memory plan sets aside; least recently used dropped first; a turn's
entry replaces the entries it extends), so that many episodes waiting on their
tools at once keep their histories.

An entry is reused only under the very weights that wrote it (``computed_by``
compares the weight objects of a version, never a model id): after a
``sync_weights`` a ``latest`` sampler's next turn prefills its history again
under the new version. A row that took an in-flight update mid-completion
holds KV of two versions and is not kept. No request can opt into reusing an
older version's KV.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model.kv_cache import KVCache
from treadle.workers.sampler.state import Row, Staged, TorchRequest, common_prefix

#: A queued request waits for one being prefilled when it could then reuse this
#: many more prompt tokens (the wait is at most that request's prefill).
MIN_PREFIX_WAIT = 16


class PrefixCache:
    """The staging slots' prefixes and the store of finished turns (at most
    ``kept_slots`` x ``stage.max_len`` tokens of KV; 0: none kept)."""

    def __init__(self, stage: KVCache, kept_slots: int = 0) -> None:
        self.stage = stage
        self.staged = [Staged() for _ in range(stage.num_slots)]
        #: how far each slot's cells may be non-zero: the longest extent anything
        #: wrote there since it was last zeroed (recorded before the write)
        self.written = [0] * stage.num_slots
        self.kept: list[Kept] = []  # finished turns' prompt + completion KV
        self.kept_tokens = 0
        self.max_kept_tokens = max(0, kept_slots) * stage.max_len

    def slot_for(self, request: TorchRequest, clock: int) -> int:
        """A free staging slot for ``request``, seeded with the longest cached prefix
        (its KV moved there; ``request.prefilled``/``reused`` set to its length);
        -1 when none is free, or when a request being prefilled now will soon
        hold a longer prefix of this prompt (then it is worth the wait)."""
        free = [i for i, s in enumerate(self.staged) if s.owner is None]
        if not free:
            return -1
        prompt = request.prompt
        if request.scorer is not None:
            # It scores its prompt: every position's logits are needed, and a
            # cached prefix has none. It reuses nothing and waits for nobody.
            return self._take(request, min(free, key=lambda i: self.staged[i].last_used), 0, clock)
        best, best_len = -1, 0
        for i, staged in enumerate(self.staged):
            n = min(staged.tokens.size, prompt.size)
            if n <= best_len or not staged.computed_by(request.snapshot):
                continue
            if staged.tokens[best_len] != prompt[best_len]:
                continue  # shares at most best_len tokens: no better (one compare)
            common = common_prefix(staged.tokens[:n], prompt[:n])
            if common > best_len:
                best, best_len = i, common
        kept, kept_len = self._best_kept(request)
        if kept_len > best_len:
            best_len = kept_len
        else:
            kept = None
        for staged in self.staged:
            # A request with the same prompt is being prefilled right now (G samples
            # sent as separate requests): wait for it, then copy instead of recompute.
            owner = staged.owner
            if owner is not None and staged.computed_by(request.snapshot):
                n = min(owner.prompt.size, prompt.size)
                if n < best_len + MIN_PREFIX_WAIT:
                    continue  # too short to share that many more tokens
                if common_prefix(owner.prompt[:n], prompt[:n]) >= best_len + MIN_PREFIX_WAIT:
                    return -1
        if kept is not None:  # a finished turn of this episode: its KV into a free slot
            slot = min(free, key=lambda i: self.staged[i].last_used)
            reuse = min(best_len, prompt.size - 1)
            self._restore(kept, slot, reuse, clock)
            return self._take(request, slot, reuse, clock)
        if best >= 0 and self.staged[best].owner is None:
            slot = best
        else:
            slot = min(free, key=lambda i: self.staged[i].last_used)
            if best >= 0:
                self.stage.move([best], [slot], best_len)
                self.written[slot] = max(self.written[slot], best_len)
        # The last prompt token is always computed: its logits choose the first token.
        return self._take(request, slot, min(best_len, prompt.size - 1), clock)

    def _take(self, request: TorchRequest, slot: int, reuse: int, clock: int) -> int:
        """``request`` prefills into ``slot``, whose first ``reuse`` tokens are its prompt's.

        What the slot holds beyond those (a former prompt's K/V, any tenant's) is
        zeroed: a padded prefill batch reads every slot up to its longest prompt."""
        self.stage.clear(range(slot, slot + 1), self.written[slot], start=reuse)
        self.written[slot] = reuse
        prompt = request.prompt
        snap = request.snapshot
        self.staged[slot] = Staged(
            tokens=prompt[:reuse].copy(),
            params=weakref.ref(snap.params),
            adapter=None if snap.adapter is None else weakref.ref(snap.adapter),
            owner=request,
            last_used=clock,
        )
        request.stage_slot, request.prefilled, request.reused = slot, reuse, reuse
        return slot

    def writing(self, batch: Sequence[tuple[TorchRequest, int]]) -> None:
        """A prefill forward is about to write ``n`` more prompt tokens of each
        ``(request, n)`` into its slot (recorded first: a forward that fails part
        way has written them too). Its padding tokens write position
        ``max_len - 1``, which nothing reads: a prompt is shorter than the context
        (``sampler_validation``), so no read, copy or move reaches it."""
        for req, n in batch:
            slot = req.stage_slot
            self.written[slot] = max(self.written[slot], req.prefilled + n)

    def advanced(self, request: TorchRequest, clock: int) -> None:
        """A prefill chunk of ``request`` is in its slot."""
        staged = self.staged[request.stage_slot]
        staged.tokens = request.prompt[: request.prefilled].copy()
        staged.last_used = clock

    def release(self, request: TorchRequest) -> None:
        """``request`` is done prefilling (or cancelled): its slot is free, and keeps
        what was computed for later prompts."""
        staged = self.staged[request.stage_slot]
        staged.owner = None
        staged.tokens = request.prompt[: request.prefilled].copy()

    def forget(self, request: TorchRequest) -> None:
        """Free ``request``'s slot and what it holds (the request failed mid-prefill)."""
        self.staged[request.stage_slot] = Staged()

    def keep_completion(self, rows: Sequence[Row], cache: KVCache, clock: int) -> None:
        """Keep the prompt + completion KV of finished rows of single-sample
        requests that asked for it (an episode's turn), before compaction
        overwrites their slots.

        Kept only when one set of weights wrote it all (no in-flight update since
        the prompt's prefill) and the row is not a resumed partial rollout."""
        for row in rows:
            req = row.request
            if (
                not req.op.params.cache_completion
                or req.op.num_samples != 1
                or row.stop_reason not in ("stop", "length")
                or req.prefix is not None
                or req.cancelled
                or row.snapshot is not req.snapshot
            ):
                continue
            n = row.position  # the last sampled token was never fed: its KV is not there
            if n <= req.prompt.size or n > self.max_kept_tokens:
                continue
            tokens = np.concatenate([req.prompt, np.asarray(row.tokens, dtype=np.int64)])[:n]
            snap = req.snapshot
            entry = Kept(
                Staged(
                    tokens=tokens,
                    params=weakref.ref(snap.params),
                    adapter=None if snap.adapter is None else weakref.ref(snap.adapter),
                    last_used=clock,
                ),
                cache.k_L_S_H_T_D[:, row.slot, :, :n].clone(),
                cache.v_L_S_H_T_D[:, row.slot, :, :n].clone(),
            )
            # the entries this one extends (the episode's earlier turns) are no longer needed
            self.kept = [k for k in self.kept if not _extends(entry, k, snap)] + [entry]
            self.kept_tokens = sum(k.staged.tokens.size for k in self.kept)
            while self.kept_tokens > self.max_kept_tokens and self.kept:
                old = min(self.kept, key=lambda k: k.staged.last_used)
                self.kept.remove(old)
                self.kept_tokens -= old.staged.tokens.size

    def _best_kept(self, request: TorchRequest) -> tuple[Kept | None, int]:
        """The kept turn sharing the longest prefix with ``request``'s prompt."""
        prompt = request.prompt
        best: Kept | None = None
        best_len = 0
        for entry in self.kept:
            tokens = entry.staged.tokens
            n = min(tokens.size, prompt.size)
            if n <= best_len or not entry.staged.computed_by(request.snapshot):
                continue
            common = common_prefix(tokens[:n], prompt[:n])
            if common > best_len:
                best, best_len = entry, common
        return best, best_len

    def _restore(self, entry: Kept, slot: int, length: int, clock: int) -> None:
        """Copy a kept turn's first ``length`` positions into staging ``slot``."""
        self.written[slot] = max(self.written[slot], length)
        self.stage.k_L_S_H_T_D[:, slot, :, :length] = entry.k_L_H_T_D[:, :, :length]
        self.stage.v_L_S_H_T_D[:, slot, :, :length] = entry.v_L_H_T_D[:, :, :length]
        entry.staged.last_used = clock


@dataclass(eq=False)  # kept entries are told apart by identity
class Kept:
    """A finished turn's prompt + completion KV (``[layers, kv_heads, tokens, head_dim]``)
    and the weights that wrote it."""

    staged: Staged
    k_L_H_T_D: torch.Tensor
    v_L_H_T_D: torch.Tensor


def _extends(new: Kept, old: Kept, snap: WeightSnapshot) -> bool:
    """``old`` is a prefix of ``new`` under the same weights."""
    a, b = old.staged.tokens, new.staged.tokens
    return (
        a.size <= b.size
        and old.staged.computed_by(snap)
        and common_prefix(a, b[: a.size]) == a.size
    )
