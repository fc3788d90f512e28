"""A load-generator backend for any OpenAI-compatible server (vLLM's ``api_server``, the
gateway's ``--http-port``), beside ``bench.serve.GrpcBackend``.

Each request is a streamed ``POST /v1/completions`` with the prompt as token ids, greedy,
``ignore_eos`` and ``min_tokens = max_tokens`` (vLLM's extra fields), so every server
generates exactly the workload's lengths; ``return_token_ids`` makes each server-sent event
carry its new token ids, so token timing does not depend on how the text detokenises.
"""
from __future__ import annotations

import json
from typing import Iterator

from splitserve.cli.workloads import BenchRequest


class OpenAIBackend:
    def __init__(self, base_url: str, model: str, timeout_s: float = 600.0):
        import httpx
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.client = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=1024))

    def stream(self, request: BenchRequest, meta: dict) -> Iterator[list[int]]:
        body = {"model": self.model, "prompt": request.prompt_token_ids, "max_tokens": request.max_tokens,
                "min_tokens": request.max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}
        with self.client.stream("POST", self.url, json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:500]!r}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if event.get("usage"):
                    meta["completion_tokens"] = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    if choice.get("token_ids"):
                        yield list(choice["token_ids"])

    def close(self) -> None:
        self.client.close()
