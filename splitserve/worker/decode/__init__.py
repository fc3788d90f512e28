"""Decode worker: reserves KV pages, admits prefilled requests, runs continuous batching, streams tokens."""
