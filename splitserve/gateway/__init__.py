"""The public gRPC gateway: admission, dispatch and the Redis-held request state."""
