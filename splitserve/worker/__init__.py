"""The worker processes: what the prefill and decode roles share, and each role's room.

``engine_loop``  the engine loop thread and its asyncio bridge
``heartbeat``    registration and heartbeat in Redis
``servicer``     the base servicer: Abort, GetWorkerInfo, draining
``serve``        a worker process's life: serve, watch the engine, drain on SIGTERM
``prefill/``, ``decode/``  each role's RPCs and wiring
"""
