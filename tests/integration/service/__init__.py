"""The service as a tenant meets it: auth, walls, quotas, bad input, migrations, metrics, TLS."""
