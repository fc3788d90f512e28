"""What the prefill and decode workers share: the engine loop thread and its asyncio bridge
(``engine_loop``), registration and heartbeat in Redis (``heartbeat``), the base servicer with
Abort, GetWorkerInfo and draining (``servicer``), and a worker process's life: serve, watch the
engine, drain on SIGTERM (``serve``). Each worker package adds only its own RPCs and wiring."""
