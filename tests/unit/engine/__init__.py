"""The engine's scheduler, fair share, call messages and their codec, options and the worker's bookkeeping."""
