"""Training end to end: ordering, losses, checkpoints, exports, loops that learn."""
