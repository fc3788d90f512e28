"""Prefill worker: runs prompts and writes their KV into pages reserved on a decode worker."""
