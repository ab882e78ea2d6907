"""The tinker-compatible HTTP API through the real tinker SDK."""
