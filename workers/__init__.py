"""The treadle worker engine: model code, trainer, sampler, scheduler (``treadle.workers``)."""
