"""What a ``ForwardBackward`` will need in memory, checked before it starts.

A batch too large for the worker would otherwise fail half-way through its
backward (or push the host into swap) after minutes of compute. The estimate
is an upper bound of what autograd keeps per token, from the model's shapes:

* per layer: the norms' inputs and outputs, q/k/v (before and after RoPE), the
  attention output, the MLP's gate, up, ``silu(gate)`` and their product;
  with activation checkpointing only each layer's input, plus one layer in
  full while it is recomputed;
* the unembedding: whole logits, the entropy's temporaries and the gradient
  (about 4 x V per token), or a constant few chunks when the trainer computes
  them in chunks (``trainer.LOGITS_CHUNK_BYTES``);
* the new gradients of every trainable tensor (``torch.autograd.grad`` returns
  them whole before they are added to the accumulated ones).

The limit is the worker's config (``EngineConfig.train_memory_limit_bytes``)
or, when that is 0, what the device has available right now (Linux
``MemAvailable``; free CUDA memory).
"""

from __future__ import annotations

from pathlib import Path

import torch

from treadle.common.engine.model_config import ModelConfig
from treadle.errors import ResourceExhaustedError
from treadle.workers.trainer.chunked_logprobs import CHUNK_BYTES


def activation_bytes(
    cfg: ModelConfig,
    rows: int,
    length: int,
    element_bytes: int,
    *,
    checkpointing: bool,
    chunked_logits: bool,
) -> int:
    """Upper bound of the bytes autograd keeps for a ``rows x length`` batch."""
    tokens = rows * length
    kv = cfg.kv_size
    per_layer = 6 * cfg.hidden_size + 5 * cfg.q_size + 4 * kv + 4 * cfg.intermediate_size
    if checkpointing:
        layers = cfg.num_layers * cfg.hidden_size + per_layer
    else:
        layers = cfg.num_layers * per_layer
    body = tokens * layers * element_bytes
    vocab = 3 * CHUNK_BYTES if chunked_logits else tokens * 4 * cfg.vocab_size * 4
    return body + vocab


def available_bytes(device: torch.device) -> int:
    """What the device can still hand out now."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62  # unknown: never refuse


def check_fits(need: int, limit: int, device: torch.device, *, checkpointing: bool) -> None:
    """RESOURCE_EXHAUSTED, naming the size and what to change, when ``need`` exceeds
    ``limit`` (0: the device's available memory)."""
    have = limit or available_bytes(device)
    if need <= have:
        return
    fixes = "split data into smaller ForwardBackward calls before one OptimStep (their "
    fixes += "gradients add up to the same step) or shorten the sequences"
    if not checkpointing:
        fixes += ", or start the worker with activation checkpointing on"
    mib = 2**20
    raise ResourceExhaustedError(
        f"data: this ForwardBackward needs about {need / mib:,.0f} MiB for activations and "
        f"gradients, the worker has {have / mib:,.0f} MiB: {fixes}"
    )
