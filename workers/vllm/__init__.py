"""workers/vllm"""
