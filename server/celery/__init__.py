"""The distributed server's side of Celery: the dispatcher that places models on
``treadle worker`` processes and routes calls to them, its transport and replies,
where models live, and the liveness watchdog."""
