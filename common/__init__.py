"""What the server and the workers both use, below both (``treadle.common``).

The checkpoint store (local directory or S3) with its ``treadle://`` names, the
database schema with its engines and the worker-registry queries, and the
parsing of the settings both processes read. It imports neither
``treadle.server`` nor ``treadle.workers``; the engine's import path does not
reach it (the engine imports with torch, transformers, safetensors and
tokenizers alone), and what it needs beyond the SDK's dependencies (sqlalchemy,
boto3) is imported by its own submodules only.
"""
