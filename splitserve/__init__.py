"""splitserve services: the public gRPC API, proto <-> domain conversion, error mapping.

Generated protobuf/gRPC modules live in ``splitserve.v1`` (regenerate with
``python -m splitserve.codegen``).
"""

from engine.openmp import prefer_passive_waiting

prefer_passive_waiting()  # before any torch import of the CLI's worker processes
