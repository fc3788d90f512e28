"""Drawing one token per row from a distribution over the vocabulary, as the sampler and the
speculative decoders do: one uniform per row (``row_uniforms``), then the inverse of the row's
cumulative distribution (``inverse_cdf``).

Why not vLLM's exponential race (``argmax(probs / q)``, ``q ~ Exp(1)`` for every vocabulary
entry): on a CPU torch draws random numbers one at a time (mt19937, ~3 ns each), so a
[32, 49152] race spent ~12 ms a step on its noise (docs/performance.md, "Host work in a step, and random sampling").
The race exists to spare a GPU a device-to-host sync; the sampled ids go to the host anyway.
"""
from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A small host list as a tensor on ``device``, without waiting for the device: a copy from
    pageable memory waits for every kernel queued before it, which would stall async scheduling
    (splitserve/engine/async_scheduling.py) on the step it just queued; one from pinned memory is
    queued behind them instead."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def row_uniforms(generators: list, shared: torch.Generator | None, dev, wanted: list[bool] | None = None) -> torch.Tensor:
    """One U[0, 1) per row where ``wanted`` (every row if None; 1.0 elsewhere): from the row's own generator when it
    has one (a seeded request stays reproducible), else from the sampler's shared one (torch's
    default RNG if None). A row not wanted draws nothing, so a request's random stream does not
    depend on what the other rows of the step did."""
    if wanted is None:
        wanted = [True] * len(generators)
    u = torch.ones(len(generators))
    shared_rows = [i for i, (g, w) in enumerate(zip(generators, wanted)) if w and g is None]
    if shared_rows:
        u[shared_rows] = torch.rand(len(shared_rows), generator=shared,
                                    device="cpu" if shared is None else shared.device).cpu()
    for i, (g, w) in enumerate(zip(generators, wanted)):
        if w and g is not None:
            u[i] = torch.rand(1, generator=g, device=g.device).item()
    return u if torch.device(dev).type == "cpu" else u.pin_memory().to(dev, non_blocking=True)


# inverse_cdf sums the vocabulary in blocks of this many tokens, then runs a cumulative sum inside
# the one block holding the target: torch's CPU cumsum is a serial loop (~0.9 ns a value, 2.8 ms
# for [64, 49152]); a sum over blocks is vectorised.
CDF_BLOCK = 256


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row of ``probs`` ([n, vocab], >= 0, need not sum to 1) whose slice of the
    row's cumulative mass holds ``u`` (one U[0, 1) per row) times the row's total.

    Two levels: the block (``CDF_BLOCK`` tokens) whose slice holds the target, then the token
    inside it. A token of probability 0 has an empty slice and is never drawn; sums are float32,
    so a token's chance is off by ~1e-7 of the row's mass at most."""
    n, vocab = probs.shape
    blocks = -(-vocab // CDF_BLOCK)
    x = probs.float()
    if blocks * CDF_BLOCK != vocab:
        x = torch.nn.functional.pad(x, (0, blocks * CDF_BLOCK - vocab))
    x = x.view(n, blocks, CDF_BLOCK)
    block_cdf = x.sum(dim=-1).cumsum(dim=-1)  # [n, blocks]
    # u < 1 keeps the target below the total (the product rounds to nearest and is at least half
    # a unit of the last place below it); right=True: the first entry above it, so never an
    # empty block.
    target = u.to(x.device, torch.float32).unsqueeze(1) * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks - 1)  # [n, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), 0.0)
    inside = x.gather(1, block.unsqueeze(-1).expand(n, 1, CDF_BLOCK)).squeeze(1).cumsum(dim=-1)  # [n, CDF_BLOCK]
    # The remainder of the target within the block, kept inside the block's own running sum
    # (summed in another order than block_cdf, the two may differ in the last place).
    end = inside[:, -1:]
    rest = torch.minimum((target - before).clamp_(min=0.0), torch.nextafter(end, torch.zeros_like(end)))
    token = torch.searchsorted(inside, rest, right=True).clamp_(max=CDF_BLOCK - 1)
    return (block * CDF_BLOCK + token).squeeze(1)
