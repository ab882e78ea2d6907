"""treadle's server: gRPC service, tenancy, storage and dispatch to the workers."""
