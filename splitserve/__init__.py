"""splitserve: LLM serving with disaggregated prefill and decode.

One package in layers; a layer imports only the layers below it (``lint-imports`` checks the
contract in ``pyproject.toml``):

``splitserve.common`` / ``splitserve.v1``  errors, logging, limits, gRPC plumbing, metrics, tracing,
                                       security; the generated API stubs (``python -m protos.codegen``)
``splitserve.engine``       paged KV cache, scheduler, model runner, attention kernels, sampling
``splitserve.kvtransfer``   moves KV pages from a prefill pool into a decode pool
``splitserve.state`` / ``splitserve.wire``  the Redis schema; proto <-> domain conversion
``splitserve.gateway`` / ``splitserve.worker`` / ``splitserve.client``  the processes' roles
``splitserve.cli``          the ``splitserve`` command: flags, config file, ``up``, sizing, tune
"""
