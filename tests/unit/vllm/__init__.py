"""The vLLM backend's pieces that run without a vLLM engine."""
