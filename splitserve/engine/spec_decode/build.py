"""The proposer an engine's config asks for."""
from __future__ import annotations

from splitserve.engine.config import EngineConfig
from splitserve.engine.spec_decode.proposer import NgramProposer, Proposer


def build_proposer(config: EngineConfig, runner) -> Proposer | None:
    """The proposer of ``config.speculative_method`` (None: speculation off). ``runner``: the
    target's ModelRunner (a draft model shares its page ids and sampler)."""
    if not config.speculative_method:
        return None
    if config.speculative_method == "ngram":
        return NgramProposer(config)
    from splitserve.engine.spec_decode.draft import DraftProposer  # loads a second model: only when asked
    return DraftProposer(config, runner)
