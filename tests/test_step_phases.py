"""Where an engine's step time goes (splitserve/engine/step_phases.py): every step that runs the
model is counted once, and each of its phases gets time; a step with nothing to run counts none."""
from splitserve.engine import SamplingParams
from splitserve.engine.step_phases import StepPhases


def test_timing_adds_each_blocks_wall_time_even_when_it_raises():
    phases = StepPhases()
    with phases.timing("forward"):
        sum(range(10_000))
    first = phases.forward
    try:
        with phases.timing("forward"):
            raise ValueError("a failed step still took its time")
    except ValueError:
        pass
    assert 0 < first < phases.forward
    assert phases.seconds() == {"schedule": 0.0, "propose": 0.0, "prepare": 0.0, "forward": phases.forward,
                                "sample": 0.0, "update": 0.0}


def test_an_engine_counts_the_steps_that_ran_the_model_and_times_every_phase(tiny_model_dirs, make_llm):
    engine = make_llm(tiny_model_dirs["llama"], block_size=8, num_gpu_blocks=64).engine
    phases = engine.runner.phases
    before = phases.steps
    for _ in range(3):
        engine.step()  # nothing to run: schedule only
    assert phases.steps == before
    engine.add_request("r", [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert phases.steps - before == 5  # the prompt's step (its first token), then four decodes
    seconds = phases.seconds()
    assert seconds["propose"] == 0.0  # no speculative decoding here
    assert all(seconds[p] > 0 for p in ("schedule", "prepare", "forward", "sample", "update")), seconds
