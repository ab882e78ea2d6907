"""Every sampler backend the conformance suite runs against
(``tests/integration/sampling/test_sampler_conformance.py``).

Adding a backend is one line in ``BACKENDS``: its ``--sampler`` name, the
server settings it runs with in tests, the logprob agreement with the trainer
it is held to, and the Python package it needs (missing: its cases skip, with
the reason).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BackendCase:
    name: str  # the --sampler value
    #: ServerConfig fields it is served with in tests (on top of the suite's own)
    settings: Mapping[str, Any] = field(default_factory=dict)
    #: the largest |sampler logprob - forward_logprobs| allowed (CPU float32)
    logprob_tolerance: float = 1e-4
    needs: str = ""  # a package that must import, or ""
    #: the session fixture whose server the case uses (one engine per session for
    #: backends slow to start), or "" for a server of the suite's own
    session_server: str = ""
    #: whether it samples with top-k/top-p at T > 0 (else it must refuse, naming the field)
    truncates: bool = True
    #: whether it scores prompt tokens (else it must refuse, naming the field)
    scores_prompt: bool = True

    def skip_reason(self) -> str | None:
        if not self.needs:
            return None
        try:
            importlib.import_module(self.needs)
        except Exception as err:
            return f"--sampler {self.name} needs {self.needs!r}: {type(err).__name__}: {err}"
        return None


BACKENDS: tuple[BackendCase, ...] = (
    BackendCase("torch"),
    BackendCase("torch-thread", {"sampler_threads": 1}),
    BackendCase("torch-process", {"sampler_threads": 1}),
    # vLLM reports the truncated distribution's logprob under top-k/top-p: refused;
    # measured agreement with the trainer 1.8e-6 (fp32, CPU), held to torch's 1e-4
    # and prompt logprobs under LoRA fail vLLM 0.32's engine: refused
    BackendCase(
        "vllm",
        needs="vllm",
        session_server="vllm_server",
        truncates=False,
        scores_prompt=False,
    ),
)


def vllm_imports() -> bool:
    """vLLM imports here (any failure to import counts as no)."""
    try:
        importlib.import_module("vllm")
    except Exception:
        return False
    return True
