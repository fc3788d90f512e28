"""What every process shares: error classes and their status codes, logging, asyncio helpers,
request limits, gRPC options and servers, metrics, tracing, security. Imports nothing else of
splitserve but the generated stubs (``splitserve.v1``)."""
