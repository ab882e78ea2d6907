"""The tinker-compatible HTTP API (``/api/v1/...``): the official ``tinker`` SDK
talks to treadle through it. Thin translators over the service layer, served by
uvicorn in the event loop of the gRPC server."""
