"""The Redis schema shared by gateways and workers: keys, Lua scripts and their Python API
(``store.RedisState``), and the clients with bounded waits that reach it (``connect``)."""
