"""Structured output through the engine with the real default model (SmolLM2-135M-Instruct).

Every constrained output must parse and validate; unconstrained requests batched beside them
must still equal transformers' greedy output; preemption and a resumed (retried) request keep
the grammar's state.
"""
import json
import re

import jsonschema
import pytest

from splitserve.engine import SamplingParams
from splitserve.engine.model_loader import DEFAULT_MODEL, resolve_model
from splitserve.engine.grammar import check_grammar
from splitserve.engine.structured_output import StructuredOutput
from tests.harness.schemas import PERSON_SCHEMA
from tests.test_engine_correctness import mixed_prompts

# Short valid outputs: bounded strings and integers, so 64 tokens always hold a whole object.
SCHEMA = PERSON_SCHEMA
SCHEMA_SPEC = StructuredOutput(json_schema=json.dumps(SCHEMA))
PEOPLE = ["Alice", "Bob", "Chen", "Dmitri", "Eve", "Fatima", "Gabriel", "Hana", "Ivan", "Jun", "Kofi", "Lena",
          "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Victor"]


@pytest.fixture(scope="module")
def smollm2_dir():
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    from splitserve.engine import LLM
    llm = LLM(model=str(smollm2_dir), dtype="float32", num_gpu_blocks=256, block_size=16, enforce_eager=True)
    yield llm
    llm.engine.assert_idle()


def chat(llm, text: str) -> list[int]:
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=False))


def person_prompt(llm, name: str) -> list[int]:
    return chat(llm, f"Write a JSON record for a user called {name}: name, age, city and whether they are an admin.")


def test_json_schema_outputs_validate_beside_unconstrained_greedy_rows(llm, smollm2_dir, hf_reference):
    """22 constrained requests (18 greedy, 4 seeded random) and 3 unconstrained ones, one batch."""
    constrained = [person_prompt(llm, name) for name in PEOPLE]
    params = [SamplingParams(temperature=0, max_tokens=64, structured_output=SCHEMA_SPEC) for _ in PEOPLE[:18]]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_output=SCHEMA_SPEC)
               for i in range(4)]
    free = mixed_prompts(3, seed=7, lo=5, hi=40, vocab=49152)
    free_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # Interleaved, so constrained and unconstrained rows share every step.
    prompts = constrained[:1] + free[:1] + constrained[1:12] + free[1:2] + constrained[12:] + free[2:]
    all_params = params[:1] + [free_params] + params[1:12] + [free_params] + params[12:] + [free_params]
    outputs = llm.generate(prompts, all_params)

    ref = hf_reference(smollm2_dir)
    free_outs = [outputs[1], outputs[13], outputs[-1]]
    for prompt, out in zip(free, free_outs):
        assert out.token_ids == ref.greedy(prompt, 8)
    json_outs = [o for i, o in enumerate(outputs) if i not in (1, 13, len(outputs) - 1)]
    assert len(json_outs) == 22
    for out in json_outs:
        value = json.loads(out.text)
        jsonschema.validate(value, SCHEMA)
        assert out.finish_reason == "eos", out  # the grammar ended and only EOS was allowed


def test_unconstrained_greedy_differs_so_the_constraint_is_doing_the_work(llm):
    """The same prompts without a schema do not give schema-valid JSON: the test above is not
    passing on the model's own habits."""
    outs = llm.generate([person_prompt(llm, name) for name in PEOPLE[:4]],
                        SamplingParams(temperature=0, max_tokens=64))
    valid = 0
    for out in outs:
        try:
            jsonschema.validate(json.loads(out.text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    assert valid < len(outs)


def test_regex_choice_and_json_object(llm):
    regex = r"[0-9]{3}-[a-z]{2,6}"
    choices = ("yes", "no", "maybe")
    prompts = [chat(llm, f"Give me a ticket code for order {i}.") for i in range(4)]
    prompts += [chat(llm, q) for q in ("Is the sky blue?", "Is fire cold?", "Will it rain tomorrow?")]
    prompts += [chat(llm, "Describe a cat as a JSON object.")]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutput(regex=regex))] * 4
    params += [SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutput(choice=choices))] * 3
    params += [SamplingParams(temperature=0, max_tokens=80, structured_output=StructuredOutput(json_object=True))]
    outs = llm.generate(prompts, params)
    for out in outs[:4]:
        assert re.fullmatch(regex, out.text), out.text
    for out in outs[4:7]:
        assert out.text in choices
    assert outs[7].finish_reason == "eos"
    assert isinstance(json.loads(outs[7].text), dict)


def test_preemption_by_recompute_keeps_the_grammar(smollm2_dir):
    """A pool too small for the batch preempts constrained requests mid-output; they re-prefill
    and go on, with the same output as without preemption."""
    from splitserve.engine import LLM
    prompts = None
    results = []
    for blocks in (256, 14):
        llm = LLM(model=str(smollm2_dir), dtype="float32", num_gpu_blocks=blocks, block_size=16, enforce_eager=True)
        prompts = prompts or [person_prompt(llm, name) for name in PEOPLE[:5]]
        results.append(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64,
                                                            structured_output=SCHEMA_SPEC)))
        llm.engine.assert_idle()
    roomy, tight = results
    assert sum(o.num_preemptions for o in tight) > 0
    for a, b in zip(roomy, tight):
        assert b.token_ids == a.token_ids
        jsonschema.validate(json.loads(b.text), SCHEMA)


def test_resumed_request_replays_its_generated_tokens(llm):
    """A retry's prompt ends with the tokens already streamed: the matcher replays them and
    the rest equals the uninterrupted output (without the replay the grammar would force a
    fresh '{' and the output would differ)."""
    prompt = person_prompt(llm, "Alice")
    [full] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, structured_output=SCHEMA_SPEC))
    k = 6
    assert len(full.token_ids) > k
    [rest] = llm.generate([prompt + full.token_ids[:k]],
                          SamplingParams(temperature=0, max_tokens=64 - k, structured_output=SCHEMA_SPEC.resumed(k)))
    assert rest.token_ids == full.token_ids[k:]
    with pytest.raises(ValueError, match="does not fit"):
        # The replayed tokens must be output the grammar accepts: a prompt tail is not.
        llm.engine.add_request("bad", prompt, SamplingParams(structured_output=SCHEMA_SPEC.resumed(3)))


@pytest.mark.parametrize("kwargs, match", [
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "json_schema must be a JSON object"),
    ({"regex": "(ab"}, "regex is not supported: Regex parsing error"),
    ({"json_schema": '{"type": "strin"}'}, 'json_schema is not supported: Unsupported type "strin"'),
    ({"choice": ()}, "choice must be a non-empty list"),
    ({"regex": "a", "choice": ("a",)}, "exactly one of"),
    ({}, "exactly one of"),
])
def test_invalid_specs_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        check_grammar(StructuredOutput(**kwargs))


def test_a_retried_job_carries_its_streamed_tokens_to_the_grammar():
    """The gateway's retry puts the streamed tokens in the prompt and says how many there are;
    the worker's engine replays exactly those (test_resumed_request_replays_its_generated_tokens)."""
    from splitserve.gateway.job import Job
    from splitserve.wire import sampling_from_worker, sampling_to_worker
    job = Job("r", [1, 2, 3], SamplingParams(max_tokens=10, structured_output=SCHEMA_SPEC), 0, 0.0, None,
              on_finish=lambda j: None)
    job.generated = [90, 91, 92, 93]
    prompt, params = job.resume_inputs()
    assert prompt == [1, 2, 3, 90, 91, 92, 93] and params.max_tokens == 6
    over_the_wire = sampling_from_worker(sampling_to_worker(params)).structured_output
    assert over_the_wire == SCHEMA_SPEC.resumed(4) and over_the_wire.key == SCHEMA_SPEC.key


def test_compiled_grammars_are_kept_up_to_a_bound(llm):
    """Clients that send a new regex each time (issue 36, point 2): the compiled grammars an
    engine keeps stay under --grammar-cache-mb, least recently used out first; a repeated spec
    is a hit. Every request is still constrained."""
    grammars = llm.engine.grammars
    saved = grammars.cache_bytes
    grammars.cache_bytes = 40_000  # a few of these small grammars (~10 KB each on SmolLM2's vocabulary)
    try:
        hits, misses = grammars.hits, grammars.misses
        prompt = chat(llm, "Say a code.")
        sizes = []
        for i in range(16):
            regex = f"c{i}[a-f]{{2}}"
            [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                         structured_output=StructuredOutput(regex=regex)))
            assert re.fullmatch(regex, llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)), out.token_ids
            sizes.append(grammars.cached_bytes)
        assert grammars.misses - misses == 16 and max(sizes) <= 40_000
        assert len(grammars._cache) < 16  # the oldest went
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                              structured_output=StructuredOutput(regex="c15[a-f]{2}")))
        assert grammars.hits - hits == 1 and grammars.misses - misses == 16
        stats = llm.engine.stats()
        assert stats["grammar_cache_bytes"] == grammars.cached_bytes and stats["grammar_cache_hits"] == grammars.hits
    finally:
        grammars.cache_bytes = saved


def test_the_grammar_cache_bound_is_checked():
    from splitserve.engine.config import EngineConfig
    with pytest.raises(ValueError, match="grammar_cache_mb"):
        EngineConfig(model="m", grammar_cache_mb=0)


def test_a_constraint_after_reasoning_starts_once_its_end_tokens_are_written(llm):
    """after_token_ids (a reasoning model's </think>): the tokens up to and including them are the
    model's own (unconstrained greedy), and the rest is exactly what the constraint gives a prompt
    that already ends with them. Stand-in for </think>: the second token unconstrained greedy
    writes, so the test does not depend on the model ever thinking."""
    prompt = person_prompt(llm, "Alice")
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3))[0].token_ids
    end = (free[1],)
    gated = SamplingParams(temperature=0, max_tokens=40,
                           structured_output=StructuredOutput(json_schema=json.dumps(SCHEMA), after_token_ids=end))
    out = llm.generate([prompt], gated)[0]
    assert out.token_ids[:2] == free[:2]
    answer = llm.generate([prompt + free[:2]], SamplingParams(temperature=0, max_tokens=38,
                                                              structured_output=SCHEMA_SPEC))[0]
    assert out.token_ids[2:] == answer.token_ids
    jsonschema.validate(json.loads(answer.text), SCHEMA)
    # Without the gate the first tokens are the constraint's, not the model's own.
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, structured_output=SCHEMA_SPEC)
                        )[0].token_ids != free[:2]


def test_an_opener_lets_the_first_token_choose_reasoning_or_the_answer(llm):
    """after_opener: a first token equal to it waits for after_token_ids (free text until then);
    any other first token is constrained at once -- and the opener is allowed beside the grammar's
    tokens, so a model whose favourite first token is the opener takes it."""
    prompt = person_prompt(llm, "Bob")
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3))[0].token_ids
    constrained = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, structured_output=SCHEMA_SPEC))[0]
    # The model's own first token opens: its reasoning runs until free[2], then the schema.
    opened = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutput(
        json_schema=json.dumps(SCHEMA), after_token_ids=(free[2],), after_opener=free[0])))[0]
    assert opened.token_ids[:3] == free[:3]
    rest = llm.generate([prompt + free[:3]], SamplingParams(temperature=0, max_tokens=37,
                                                            structured_output=SCHEMA_SPEC))[0]
    assert opened.token_ids[3:] == rest.token_ids
    # An opener the model does not pick first: constrained from the first token, as without a gate.
    other = next(t for t in range(100, 200) if t not in free)
    answered = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutput(
        json_schema=json.dumps(SCHEMA), after_token_ids=(free[2],), after_opener=other)))[0]
    assert answered.token_ids == constrained.token_ids
    jsonschema.validate(json.loads(answered.text), SCHEMA)
