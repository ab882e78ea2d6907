"""Training: one model's weights, gradients and optimizer (``trainer``), AdamW,
the loss registry (``losses/``), cross-model batched passes, the logprob
kernels, memory checks, reference weights, checkpoints and exports."""
