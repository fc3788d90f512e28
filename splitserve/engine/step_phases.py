"""Where an engine's step time goes: seconds per phase, summed over every step it has run.

``LLMEngine.step`` is schedule -> (propose) -> prepare -> forward -> sample -> update; each
phase adds its wall time here, so a reader can divide any two snapshots by the steps between
them (a worker exports these as ``splitserve:engine_step_seconds{phase}`` and
``splitserve:engine_steps``). On a GPU the forward returns once its kernels are queued: its
time then shows up partly under ``sample``, which waits for the sampled ids on the host.
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from typing import Iterator


@dataclasses.dataclass
class StepPhases:
    # Steps that ran the model (an empty plan's step adds to ``schedule`` alone).
    steps: int = 0
    # Scheduler.schedule: admission, pages, preemption, the step's rows.
    schedule: float = 0.0
    # A draft model's or n-gram proposals (speculative decoding only).
    propose: float = 0.0
    # The step's input tensors (token ids, positions, page tables), LoRA rows, tensor-parallel broadcast.
    prepare: float = 0.0
    # The model's forward through its attention and the logits of the sampled rows.
    forward: float = 0.0
    # Sampling, or verification of proposals, down to host token ids.
    sample: float = 0.0
    # Scheduler.update (tokens appended, stops, pages freed) and the step's outputs.
    update: float = 0.0

    PHASES = ("schedule", "propose", "prepare", "forward", "sample", "update")

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Adds the block's wall time to ``phase``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, phase, getattr(self, phase) + time.perf_counter() - started)

    def seconds(self) -> dict[str, float]:
        return {phase: getattr(self, phase) for phase in self.PHASES}
