"""What restarts and failures do: the server, the broker, the database, the store."""
