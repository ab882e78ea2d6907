"""treadle: write the RL loop locally, run the heavy steps on shared workers.

import treadle
service = treadle.ServiceClient("localhost:50051")
trainer = service.create_lora_training_client("demo", rank=8)  # a base model it serves
sampler = trainer.sync_weights()
"""

from typing import TYPE_CHECKING, Any

from treadle.errors import (
    AbortedError,
    FailedPreconditionError,
    InvalidArgumentError,
    NoGradientWarning,
    NotFoundError,
    ResourceExhaustedError,
    ServerRestartedError,
    TreadleError,
    UnauthenticatedError,
    UnavailableError,
)

if TYPE_CHECKING:
    from treadle.futures import APIFuture
    from treadle.sampling_client import SamplingClient
    from treadle.service_client import ServiceClient
    from treadle.tokenizer import Tokenizer
    from treadle.training_client import TrainingClient
    from treadle.types import (
        AdamParams,
        CheckpointInfo,
        Datum,
        ForwardBackwardOutput,
        LossFnOutput,
        ModelInfo,
        ModelInput,
        OptimStepResponse,
        RunUsage,
        SampledSequence,
        SampleResponse,
        SamplingParams,
        SaveStateResponse,
        ServerInfo,
        StreamedSample,
        TrainingPassMetrics,
        VersionSpan,
        WorkerInfo,
    )

#: the client's names, imported on first use: the engine (``treadle.workers``)
#: lives under this package and must import on a GPU host without grpcio
_LAZY = {
    "APIFuture": "treadle.futures",
    "SamplingClient": "treadle.sampling_client",
    "ServiceClient": "treadle.service_client",
    "Tokenizer": "treadle.tokenizer",
    "TrainingClient": "treadle.training_client",
    **{
        name: "treadle.types"
        for name in (
            "AdamParams",
            "CheckpointInfo",
            "Datum",
            "ForwardBackwardOutput",
            "LossFnOutput",
            "ModelInfo",
            "ModelInput",
            "OptimStepResponse",
            "SampledSequence",
            "SampleResponse",
            "SamplingParams",
            "SaveStateResponse",
            "ServerInfo",
            "StreamedSample",
            "TrainingPassMetrics",
            "RunUsage",
            "VersionSpan",
            "WorkerInfo",
        )
    },
}
#: submodules reachable as attributes of ``treadle`` once it is imported
_SUBMODULES = frozenset(
    {"futures", "sampling_client", "service_client", "tokenizer", "training_client", "types", "rl"}
)


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"treadle.{name}")
    else:
        raise AttributeError(f"module 'treadle' has no attribute {name!r}")
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "APIFuture",
    "AbortedError",
    "AdamParams",
    "CheckpointInfo",
    "Datum",
    "FailedPreconditionError",
    "ForwardBackwardOutput",
    "InvalidArgumentError",
    "LossFnOutput",
    "ModelInfo",
    "ModelInput",
    "NoGradientWarning",
    "NotFoundError",
    "OptimStepResponse",
    "ResourceExhaustedError",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "SaveStateResponse",
    "ServerInfo",
    "ServerRestartedError",
    "ServiceClient",
    "StreamedSample",
    "Tokenizer",
    "TrainingClient",
    "TrainingPassMetrics",
    "RunUsage",
    "TreadleError",
    "UnauthenticatedError",
    "UnavailableError",
    "VersionSpan",
    "WorkerInfo",
    "__version__",
]
