"""The worker: a gRPC servicer over the engine (roles: both, prefill, decode)."""
