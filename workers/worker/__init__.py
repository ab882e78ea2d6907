"""``treadle worker``: the Celery process that hosts one engine, and its config."""
