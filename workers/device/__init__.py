"""Where the engine's tensors live and what fits there: the ``--device`` choice and
its dtypes (``device``), sizing by memory (``memory_budget``: the KV cache, the
model-creation refusal), what the device's memory holds now (``memory_reading``:
the operator's view) and how the process allocates host memory
(``host_allocator``)."""
