"""The torch sampler: continuous batching, prefix cache, partial rollouts, its thread and process hosts."""
