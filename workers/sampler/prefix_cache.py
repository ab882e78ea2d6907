"""The torch sampler's staging cache, which doubles as its prefix cache.

A request's prompt is prefilled into a slot of a small *staging* KV cache (in
chunks, ``TorchSampler._prefill``), then copied into the main cache's rows. The
slot keeps the prompt's KV afterwards: a later prompt that starts like a staged
one, under the same weights, copies that KV and prefills only the rest (the G
samples of a group sent as separate requests share one prefill so).
"""

from __future__ import annotations

import weakref

from treadle.workers.model.kv_cache import KVCache
from treadle.workers.sampler.state import Staged, TorchRequest, common_prefix

#: A queued request waits for one being prefilled when it could then reuse this
#: many more prompt tokens (the wait is at most that request's prefill).
MIN_PREFIX_WAIT = 16


class PrefixCache:
    def __init__(self, stage: KVCache) -> None:
        self.stage = stage
        self.staged = [Staged() for _ in range(stage.num_slots)]

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
        return self._take(request, slot, min(best_len, prompt.size - 1), clock)

    def _take(self, request: TorchRequest, slot: int, reuse: int, clock: int) -> int:
        """``request`` prefills into ``slot``, whose first ``reuse`` tokens are its prompt's."""
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
