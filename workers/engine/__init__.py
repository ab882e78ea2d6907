"""The engine: its loop (``loop``), the pure scheduler, the ordered executor and
the handlers of calls and ops (``calls``, ``op_handlers``), storage staging,
published weight versions, base models, the device and the engine's settings."""
