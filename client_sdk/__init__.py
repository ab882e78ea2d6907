"""treadle: write the RL loop locally, run the heavy steps on shared workers.

import treadle
service = treadle.ServiceClient("localhost:50051")
trainer = service.create_lora_training_client("demo", rank=8)  # a base model it serves
sampler = trainer.sync_weights()
"""

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
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveStateResponse,
    ServerInfo,
    StreamedSample,
    TrainingPassMetrics,
    VersionSpan,
)

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
    "TreadleError",
    "UnauthenticatedError",
    "UnavailableError",
    "VersionSpan",
    "__version__",
]
