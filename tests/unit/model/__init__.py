"""The engine's own model: forward pass, LoRA, prepacked weights, device and memory sizing."""
