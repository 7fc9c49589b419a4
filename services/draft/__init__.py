"""The draft service: a draft model for speculative decoding, shared by workers over gRPC."""
