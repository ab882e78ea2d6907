"""The gRPC transport: servicers, the interceptors (auth, errors) and the wire <->
domain conversion (``convert``), thin translators over the service layer."""
