"""Speculative decoding: cheap proposals for the next tokens of each decoding sequence,
verified by the target model in one forward (``splitserve.engine.spec_decode.rejection``).

The step becomes: schedule (decodes reserve proposal slots) → propose (fill them) → run (the
target's forward over [newest token, proposals], then verification) → update (keep the accepted
run, give back the pages past it). Methods: ``ngram`` (prompt lookup) and ``draft`` (a small
model). See ``splitserve.engine.spec_decode.proposer.build_proposer``. (Nothing is imported here: the
request and scheduler modules import ``state`` from this package.)
"""
