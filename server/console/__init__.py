"""The web console on the HTTP port (``/console``): a tenant's runs, curves,
checkpoints and cost; the operator's tenants, workers and queue. Server-rendered
pages (Jinja2) over the same service layer, keys and walls as the API.

Its own room: it imports the service layer, ``server.db`` and ``server.accounting``;
the HTTP app (``server.http.app``) mounts its router; nothing else imports it.
"""
