"""workers/sampler/process"""
