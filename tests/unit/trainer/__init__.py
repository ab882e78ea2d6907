"""The trainer: losses, AdamW, logprob kernels, batched passes and their threads."""
