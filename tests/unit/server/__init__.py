"""The server's service layer, database queries, interceptors and HTTP helpers, without a running server."""
