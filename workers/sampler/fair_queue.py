"""The torch sampler's queue: fair across tenants, never first come first
served between them.

Start-time fair queueing by tokens (Goyal et al.): a request's start tag is
the later of the last admitted tag and its tenant's previous finish tag; its
finish tag adds its tokens (prompt + samples x max_tokens). Requests are
admitted in start-tag order, so a tenant with 100 queued requests and one with
1 take turns, and each tenant's own requests keep their order.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from treadle.workers.sampler.state import TorchRequest, start_tag

#: tenants remembered with a finish tag; beyond it those with nothing queued ahead go
MAX_TENANTS = 1024


class FairQueue:
    def __init__(self) -> None:
        self._queue: deque[TorchRequest] = deque()  # in start-tag order
        self._vtime = 0.0  # start tag of the request admitted last
        self._finish_tags: dict[str, float] = {}  # tenant -> finish tag of its last request

    def push(self, request: TorchRequest) -> None:
        cost = request.prompt.size + request.op.num_samples * request.op.params.max_tokens
        start = max(self._vtime, self._finish_tags.get(request.tenant, 0.0))
        self._finish_tags[request.tenant] = start + cost
        if len(self._finish_tags) > MAX_TENANTS:  # forget tenants with nothing queued ahead
            self._finish_tags = {t: f for t, f in self._finish_tags.items() if f > self._vtime}
        request.tag = start
        self._queue.insert(bisect.bisect_right(self._queue, start, key=start_tag), request)

    def peek(self) -> TorchRequest:
        """The request admitted next."""
        return self._queue[0]

    def pop(self) -> TorchRequest:
        """Admit the first request: virtual time moves to its start tag."""
        request = self._queue.popleft()
        self._vtime = max(self._vtime, request.tag)
        return request

    def drop_cancelled(self) -> None:
        if any(r.cancelled for r in self._queue):
            self._queue = deque(r for r in self._queue if not r.cancelled)

    def clear(self) -> None:
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[TorchRequest]:
        return iter(self._queue)
