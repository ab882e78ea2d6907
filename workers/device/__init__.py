"""Where the engine's tensors live and what fits there: the ``--device`` choice and
its dtypes (``device``), sizing by memory (``memory_budget``: the KV cache, the
model-creation refusal) and how the process allocates host memory
(``host_allocator``)."""
