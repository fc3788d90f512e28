"""splitserve services: the public gRPC API, proto <-> domain conversion, error mapping.

Generated protobuf/gRPC modules live in ``splitserve.v1`` (regenerate with
``python -m splitserve.codegen``).
"""
