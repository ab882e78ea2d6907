"""The vLLM sampler backend (``--sampler vllm``): its engines per base model,
LoRA and full fine-tune versions as vLLM reads them, parameters and stats."""
