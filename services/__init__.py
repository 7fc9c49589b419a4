"""tandem's services: one process each. Their gRPC code is the generated package tandem.v1
(`make proto`, from protos/)."""
