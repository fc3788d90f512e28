"""Speculative decoding: cheap proposals for the next tokens of each decoding sequence,
verified by the target model in one forward (``splitserve.engine.rejection_sampler``).

The step becomes: schedule (decodes reserve proposal slots) → propose (fill them) → run (the
target's forward over [newest token, proposals], then verification) → update (keep the accepted
run, give back the pages past it). Methods: ``ngram`` (prompt lookup) and ``draft`` (a small
model). See ``splitserve.engine.spec_decode.build.build_proposer``. Each request's speculation
state and the engine's counters live in ``splitserve.engine.spec_state`` (the request and the
scheduler keep them; nothing here is imported by them).
"""
