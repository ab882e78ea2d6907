"""The engine's own Llama-family model: config, forward pass, KV cache, LoRA, checkpoints.

One forward (``llama.forward_hidden``) serves trainer and sampler alike, so
their logprobs agree; transformers is only the reference it is tested against.
"""

from treadle.common.engine.model_config import ModelConfig
from treadle.workers.model.kv_cache import KVCache
from treadle.workers.model.llama import (
    LlamaParams,
    forward_hidden,
    lm_logits,
    target_logprobs,
)
from treadle.workers.model.loading import load_checkpoint, save_params
from treadle.workers.model.lora import LoraAdapter, LoraRows

__all__ = [
    "KVCache",
    "LlamaParams",
    "LoraAdapter",
    "LoraRows",
    "ModelConfig",
    "forward_hidden",
    "lm_logits",
    "load_checkpoint",
    "save_params",
    "target_logprobs",
]
