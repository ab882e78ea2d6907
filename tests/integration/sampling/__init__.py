"""Sampling end to end: backends' conformance, parameters, logprob agreement, async sampling."""
