"""Storage both processes share: the SQLAlchemy rows (``models``), engines and
sessions (``engine``), and the worker registry (``workers``: registration,
heartbeats, liveness, placement). The schema's upgrades and the server's own
queries stay in ``treadle.server.db``.
"""
