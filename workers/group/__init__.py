"""A worker as a group of ranks on torch.distributed (``--ranks N``): rank 0 runs the
engine and decides; every rank executes each training call (``engine.peers``)."""
