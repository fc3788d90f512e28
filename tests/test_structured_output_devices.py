"""Structured output on each device: the token bitmask applied to CPU and CUDA logits alike, and
the engine on a tiny random Llama (byte-level tokenizer) whose outputs only the grammar can
make valid. The ``cuda`` cases (``-m gpu``) need no weights on the GPU machine, hence the random
model; they are not in ``bench.gpu_check``'s list, since its carry has no room for xgrammar's
wheels (xgrammar, apache-tvm-ffi, pydantic: ~27 MB unpacked). The real-model tests are in
tests/test_structured_output.py."""
import json
import re

import pytest
import torch

from splitserve.engine import SamplingParams
from splitserve.engine.grammar import GrammarCompiler, apply_grammar_bitmask
from splitserve.engine.structured_output import StructuredOutput

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SCHEMA = {"type": "object", "properties": {"c": {"enum": ["x", "yy"]}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
          "required": ["c", "n"]}


@pytest.mark.parametrize("device", DEVICES)
def test_bitmask_masks_exactly_the_refused_tokens(device, tiny_model_dirs):
    from splitserve.engine.model_loader import load_tokenizer
    tok = load_tokenizer(tiny_model_dirs["llama"])
    vocab = len(tok) + 5  # a logits row wider than the tokenizer, as many models have
    compiler = GrammarCompiler(tok, vocab, [tok.eos_token_id])
    g = compiler.grammar(StructuredOutput(regex="ab"))
    logits = torch.randn(3, vocab, device=device)
    before = logits.clone()
    apply_grammar_bitmask(logits, [None, g, None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]) in ("a", "ab") for t in allowed)
    assert torch.equal(logits[1][allowed], before[1][allowed])


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_model_outputs_follow_their_grammar_beside_free_rows(device, tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"], device=device, num_gpu_blocks=64)
    specs = [StructuredOutput(json_schema=json.dumps(SCHEMA)), StructuredOutput(regex="[a-c]{2}-[0-9]"),
             StructuredOutput(choice=("left", "right")), None]
    prompts = [[10 + i, 20, 30] for i in range(8)]
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=32, structured_output=specs[i % 4],
                             ignore_eos=specs[i % 4] is None) for i in range(8)]
    outs = llm.generate(prompts, params)
    for i, out in enumerate(outs):
        kind = i % 4
        if kind == 0:
            value = json.loads(out.text)
            assert value["c"] in ("x", "yy") and 0 <= value["n"] <= 9 and set(value) == {"c", "n"}
        elif kind == 1:
            assert re.fullmatch("[a-c]{2}-[0-9]", out.text), out.text
        elif kind == 2:
            assert out.text in ("left", "right")
        else:
            assert len(out.token_ids) == 32
