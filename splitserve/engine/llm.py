"""The offline API vLLM users know: ``LLM(model=...).generate(prompts, sampling_params)``."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str = EngineConfig.model, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    def add_lora(self, name: str, path) -> None:
        """Serve the PEFT adapter in directory ``path`` as ``name`` (needs ``enable_lora=True``)."""
        self.engine.add_lora(name, path)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.
        ``lora``: the adapter (``add_lora``) of every prompt, or one per prompt (None: the base model)."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")

        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora names for {len(prompts)} prompts")

        ids = []
        try:
            for prompt, p, prio, adapter in zip(prompts, params, priorities, loras):
                if adapter is not None:
                    p = dataclasses.replace(p, lora=adapter)
                ids.append(self.engine.add_request(None, prompt, p, priority=prio).request_id)
            finished: dict[str, RequestOutput] = {}
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        except BaseException:
            for request_id in ids:  # nothing stays queued behind a failed call
                self.engine.abort_request(request_id)
            with contextlib.suppress(Exception):  # the error raised below is the one to see
                self.engine.land()  # a step in flight holds their pages until it lands
            raise
        return [finished[i] for i in ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
