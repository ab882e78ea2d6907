"""Sampling: the ``SamplerBackend`` interface every backend keeps (``backend``,
``backends``), and the torch sampler: continuous batching over a KV cache
(``torch_sampler``, ``state``, ``forward``), its token choice, prefix cache,
partial rollouts and fair queue; on the engine's thread, its own (``thread``)
or its own process (``process/``)."""
