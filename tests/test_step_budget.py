"""The token budget under --target-tpot-ms: the model it learns, and an engine that keeps its
tokens exact while it cuts prompts into smaller chunks beside running decodes."""
from splitserve.engine import SamplingParams
from splitserve.engine.step_budget import StepBudget
from tests.harness.prompts import mixed_prompts


def test_budget_leaves_prompts_what_the_target_allows():
    budget = StepBudget(target_ms=20, max_tokens=512, min_prompt_tokens=16)
    assert budget.budget(num_decodes=4) == 512  # nothing learnt yet: no reason to hold back
    budget.observe(num_decodes=4, num_prompt_tokens=0, seconds=0.010)
    budget.observe(num_decodes=4, num_prompt_tokens=100, seconds=0.060)  # 0.5 ms per prompt token
    # 10 ms of decodes + 20 prompt tokens at 0.5 ms = the 20 ms target.
    assert budget.budget(num_decodes=4) == 4 + 20
    assert budget.budget(num_decodes=0) == 512  # no decode to protect: prompts take it all


def test_budget_never_starves_prompts_and_follows_a_changing_cost():
    budget = StepBudget(target_ms=5, max_tokens=512, min_prompt_tokens=16)
    budget.observe(num_decodes=8, num_prompt_tokens=0, seconds=0.010)  # decodes alone exceed the target
    budget.observe(num_decodes=8, num_prompt_tokens=64, seconds=0.030)
    assert budget.budget(num_decodes=8) == 8 + 16

    budget = StepBudget(target_ms=50, max_tokens=4096, min_prompt_tokens=16)
    budget.observe(1, 0, 0.010)
    budget.observe(1, 100, 0.110)  # 1 ms per token: 40 fit
    first = budget.budget(1)
    for _ in range(30):  # prompts got 10x cheaper: the budget grows towards 400
        budget.observe(1, 100, 0.020)
    assert first == 41 and budget.budget(1) > 300


def test_engine_with_a_target_chunks_prompts_beside_decodes_and_keeps_greedy_tokens(tiny_model_dirs, make_llm):
    """A target no step can meet (1 us) leaves each step with the decodes and the smallest prompt
    chunk (one block); without decodes a prompt still gets the whole budget; tokens are unchanged."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    short, long_a, long_b = mixed_prompts(3, seed=7, lo=60, hi=60)
    long_a, long_b = long_a * 3, long_b * 3  # 180 tokens each

    def run(**kwargs):
        engine = make_llm(tiny_model_dirs["llama"], block_size=8, num_gpu_blocks=128, max_num_batched_tokens=256,
                          **kwargs).engine
        engine.add_request("short", short, params)
        engine.add_request("a", long_a, params)
        outputs = {}
        step_plans = []
        original = engine.scheduler.schedule

        def recording():
            plan = original()
            step_plans.append([(c.request.request_id, c.num_tokens) for c in plan.chunks])
            return plan
        engine.scheduler.schedule = recording
        for i in range(40):
            if i == 4:
                engine.add_request("b", long_b, params)  # arrives while short and a decode
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.token_ids
            if not engine.has_unfinished_requests():
                break
        return outputs, step_plans

    plain, plain_plans = run()
    held, held_plans = run(target_tpot_ms=0.001)
    assert held == plain and set(held) == {"short", "a", "b"}
    assert prompt_chunks(plain_plans, "b", 180) == [180]  # one chunk: the budget had room
    held_chunks = prompt_chunks(held_plans, "b", 180)
    # A block per step while short and a decode; once they are done b gets the rest at once.
    assert held_chunks[:5] == [8] * 5 and sum(held_chunks) == 180


def prompt_chunks(plans, request_id: str, prompt_len: int) -> list[int]:
    """The sizes of the chunks that computed a request's prompt, in step order."""
    chunks = []
    for plan in plans:
        for rid, n in plan:
            if rid == request_id and sum(chunks) < prompt_len:
                chunks.append(n)
    return chunks
