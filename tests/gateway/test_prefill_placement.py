"""Conditional disaggregation's decisions on their inputs (splitserve/gateway/prefill_placement.py), and
the directory's part in them: the prefill queue it reports and whom it lets serve. Through a served
stack: tests/service/test_conditional_disaggregation.py."""
import asyncio

import pytest

from splitserve.gateway.prefill_placement import DisaggregationPolicy, PlacementInputs
from splitserve.gateway.workers import WorkerDirectory
from tests.gateway.test_gateway_routing import FakeState, entry, placed


def inputs(prompt=100, cached=0, budget=None, queue=0.0, local=0) -> PlacementInputs:
    return PlacementInputs(prompt_tokens=prompt, cached_tokens=cached, step_prompt_budget=budget,
                           prefill_queue=queue, local_prefills=local)


AUTO = DisaggregationPolicy("auto", local_prefill_tokens=64, prefill_queue_limit=2)


def decision(policy, **kw) -> tuple[str, str]:
    placement = policy.decide(inputs(**kw))
    return placement.where, placement.reason


def test_always_and_never_ignore_the_request():
    for kw in ({"prompt": 4}, {"prompt": 5000, "queue": 50.0}, {"prompt": 100, "cached": 96}):
        assert decision(DisaggregationPolicy("always"), **kw) == ("remote", "always")
        assert decision(DisaggregationPolicy("never"), **kw) == ("local", "never")


def test_auto_short_prompts_stay_on_the_decode_worker():
    assert decision(AUTO, prompt=64) == ("local", "short_prompt")
    assert decision(AUTO, prompt=65) == ("remote", "long_prompt")


def test_auto_counts_what_the_decode_worker_caches():
    """A long conversation whose history the decode worker holds computes only its new turn there."""
    placement = AUTO.decide(inputs(prompt=1000, cached=960))
    assert (placement.where, placement.reason, placement.uncached_tokens) == ("local", "short_prompt", 40)
    assert decision(AUTO, prompt=1000, cached=900) == ("remote", "long_prompt")
    # A directory entry longer than the prompt (its last block only partly the prompt's) computes nothing.
    assert AUTO.decide(inputs(prompt=10, cached=16)).uncached_tokens == 0


def test_auto_limit_lowered_to_the_decode_workers_step_budget():
    """Under a TPOT target a local prompt must fit what one step takes beside the decodes."""
    assert decision(AUTO, prompt=40, budget=48) == ("local", "short_prompt")
    assert decision(AUTO, prompt=50, budget=48) == ("remote", "long_prompt")
    assert decision(AUTO, prompt=50, budget=None) == ("local", "short_prompt")
    # A budget above the flag does not raise it.
    assert decision(AUTO, prompt=100, budget=4096) == ("remote", "long_prompt")


def test_auto_backed_up_prefill_pool_one_local_prompt_at_a_time():
    # Off by default: a long prompt stays remote however busy the prefill workers are.
    assert decision(DisaggregationPolicy("auto", local_prefill_tokens=64), prompt=500, queue=50.0) == \
        ("remote", "long_prompt")
    assert decision(AUTO, prompt=500, queue=1.5) == ("remote", "long_prompt")
    assert decision(AUTO, prompt=500, queue=2.0) == ("local", "prefill_queue")
    # The decode worker already prefills one of ours: its decodes are not slowed by a second.
    assert decision(AUTO, prompt=500, queue=9.0, local=1) == ("remote", "long_prompt")
    # A short prompt is local whatever runs there.
    assert decision(AUTO, prompt=10, queue=0.0, local=3) == ("local", "short_prompt")


def test_auto_without_a_prefill_worker_prefills_locally():
    assert decision(AUTO, prompt=5000, queue=None) == ("local", "no_prefill_worker")


@pytest.mark.parametrize("kw, flag", [({"disaggregation": "sometimes"}, "--disaggregation"),
                                      ({"local_prefill_tokens": -1}, "--local-prefill-tokens"),
                                      ({"prefill_queue_limit": -1}, "--prefill-queue-limit")])
def test_bad_settings_are_refused_naming_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        DisaggregationPolicy(**kw)


def test_bad_flag_is_a_usage_error_at_start(capsys):
    from splitserve.cli.commands import main
    assert main(["gateway", "--redis-url", "redis://127.0.0.1:1", "--model", "x", "--local-prefill-tokens", "-1"]) == 2
    assert "--local-prefill-tokens must be >= 0" in capsys.readouterr().err


# ---- the directory's inputs ------------------------------------------------------------------------

def test_prefill_queue_is_the_cheapest_route_and_counts_other_gateways():
    near = placed("p-near", "prefill", "h1", ["shm", "tcp"], running=0)
    far = placed("p-far", "prefill", "h2", ["shm", "tcp"], running=0)
    decode = placed("d1", "decode", "h1", ["shm", "tcp"])
    directory = WorkerDirectory(FakeState([near, far, decode]))
    d1 = asyncio.run(directory.decode_candidates())[0]
    assert asyncio.run(directory.prefill_queue(d1)) == 0.0  # the same-host one, free
    directory.track("p-near", +3)
    assert asyncio.run(directory.prefill_queue(d1)) == 1.0  # now the one across the network (tcp costs 1)
    # Another gateway's requests show in the heartbeat: the larger count of the two counts.
    near["stats"]["num_running"], near["stats"]["num_waiting"] = 1, 4
    directory = WorkerDirectory(FakeState([near, decode]))
    assert asyncio.run(directory.prefill_queue(d1)) == 5.0
    directory.track("p-near", +7)
    assert asyncio.run(directory.prefill_queue(d1)) == 7.0
    directory = WorkerDirectory(FakeState([decode]))
    assert asyncio.run(directory.prefill_queue(asyncio.run(directory.decode_candidates())[0])) is None


def test_a_decode_worker_alone_serves_unless_every_prompt_needs_a_prefill_worker():
    workers = [entry("d1", "decode")]
    assert not asyncio.run(WorkerDirectory(FakeState(workers)).can_serve())
    for policy in ("never", "auto"):
        assert asyncio.run(WorkerDirectory(FakeState(workers), disaggregation=DisaggregationPolicy(policy)).can_serve())


def test_step_budget_read_from_the_heartbeat():
    with_target, without = entry("d1", "decode"), entry("d2", "decode")
    with_target["stats"]["step_prompt_budget"], without["stats"]["step_prompt_budget"] = 37, -1
    views = {w.worker_id: w for w in asyncio.run(WorkerDirectory(FakeState([with_target, without])).list())}
    assert views["d1"].step_prompt_budget == 37 and views["d2"].step_prompt_budget is None
