"""The test harness, shared by the test suite and the benchmarks (outside the wheel).

``stack``         a whole splitserve stack as real processes on loopback (``start_stack``)
``redis_server``  a private, throw-away redis-server (``RedisServer``)
``tiny_models``   tiny random Llama / Qwen2 / Mistral checkpoints with a byte-level tokenizer
``prompts``       reproducible random prompts (``mixed_prompts``)
``streams``       greedy requests streamed on threads, checked against a reference
``tools``         grpcurl, a Prometheus scrape
``fuzz_api``      hypothesis strategies for every public request

Nothing here is imported by the services themselves.
"""
