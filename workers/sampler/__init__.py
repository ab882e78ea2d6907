"""workers/sampler"""
