"""The role controller's decisions on their inputs (splitserve/cli/role_controller.py): which move the
latencies and loads ask for, hysteresis, the rate bound, the minimums, the fleet checks at start, and
the windowed quantiles it reads from the gateway's histograms. A move under load through ``up``:
tests/service/test_role_change.py."""
import math

import pytest

from splitserve.cli.role_controller import (PATIENCE, Latencies, RoleControl, RolePolicy, Signals, window_quantile,
                                            worker_load)

CONTROL = RoleControl(role_controller=True, min_prefill_workers=0, min_decode_workers=1, role_ttft_target_ms=1000,
                      role_tpot_target_ms=50, role_check_interval_s=1, role_change_interval_s=30)


def signals(ttft, tpot, queue=2.0, running=4.0) -> Signals:
    return Signals(Latencies(ttft, tpot), queue, running)


def wanted(sig, prefill=1, decode=2, control=CONTROL):
    move = RolePolicy(control).wanted(sig, prefill, decode)
    return move.to_role if move else None


def test_late_first_tokens_with_tokens_on_time_ask_for_a_prefill_worker():
    assert wanted(signals(1500, 30)) == "prefill"
    assert wanted(signals(1500, 30, queue=None)) == "prefill"  # no prefill worker: the decode workers prefill


def test_late_tokens_with_first_tokens_on_time_ask_for_a_decode_worker():
    assert wanted(signals(400, 80)) == "decode"


@pytest.mark.parametrize("sig", [signals(1500, 80), signals(400, 30), signals(None, 80), signals(1500, None),
                                 signals(1500, 45),  # TPOT under target but without the headroom
                                 signals(900, 80),  # TTFT under target but without the headroom
                                 signals(1500, 30, queue=0.5),  # late first tokens, but nothing queues on prefill
                                 signals(400, 80, running=0.0)])  # late tokens, but nothing decodes
def test_no_move_when_both_or_neither_are_late_or_the_load_does_not_say(sig):
    assert wanted(sig) is None


def test_minimums_hold():
    assert wanted(signals(1500, 30), decode=1) is None  # the last decode worker stays
    control = RoleControl(role_controller=True, min_prefill_workers=1, role_tpot_target_ms=50)
    assert wanted(signals(400, 80), prefill=1, control=control) is None
    assert wanted(signals(400, 80), prefill=2, control=control) == "decode"


def test_a_move_needs_patience_and_then_waits_out_the_change_interval():
    policy = RolePolicy(CONTROL)
    late = signals(1500, 30)
    for i in range(PATIENCE - 1):
        assert policy.observe(late, 1, 2, now_s=i) is None
    move = policy.observe(late, 1, 2, now_s=PATIENCE)
    assert move is not None and move.to_role == "prefill" and "TTFT p90 1500 ms" in move.why
    # The same condition again, held long enough, but within the change interval: no move.
    for i in range(PATIENCE * 2):
        assert policy.observe(late, 2, 2, now_s=PATIENCE + 1 + i) is None
    assert policy.observe(late, 2, 2, now_s=PATIENCE + 30) is not None  # interval over, streak long enough


def test_a_broken_streak_starts_again():
    policy = RolePolicy(CONTROL)
    late, calm = signals(1500, 30), signals(400, 30)
    sequence = [late] * (PATIENCE - 1) + [calm] + [late] * (PATIENCE - 1)
    assert all(policy.observe(sig, 1, 2, now_s=i) is None for i, sig in enumerate(sequence))
    # A flip in direction also restarts it.
    policy = RolePolicy(CONTROL)
    other = signals(400, 80)
    sequence = [late] * (PATIENCE - 1) + [other] * (PATIENCE - 1)
    assert all(policy.observe(sig, 1, 2, now_s=i) is None for i, sig in enumerate(sequence))


@pytest.mark.parametrize("kw, prefill, decode, policy, flag", [
    ({"min_prefill_workers": 2, "min_decode_workers": 2}, 1, 2, "always", "--min-prefill-workers 2 plus"),
    ({"min_prefill_workers": 2}, 1, 3, "always", "starts below --min-prefill-workers"),
    ({"min_prefill_workers": 0}, 1, 1, "always", "--min-prefill-workers 0 leaves decode workers alone"),
    ({}, 0, 0, "always", "a colocated worker has no role"),
])
def test_fleets_the_minimums_cannot_hold_are_refused(kw, prefill, decode, policy, flag):
    with pytest.raises(ValueError, match=flag):
        RoleControl(role_controller=True, **kw).check_fleet(prefill, decode, policy)
    RoleControl(role_controller=True, min_prefill_workers=0).check_fleet(1, 1, "auto")  # this one holds


@pytest.mark.parametrize("kw, flag", [({"min_decode_workers": 0}, "--min-decode-workers"),
                                      ({"min_prefill_workers": -1}, "--min-prefill-workers"),
                                      ({"role_tpot_target_ms": 0}, "--role-tpot-target-ms"),
                                      ({"role_change_interval_s": -1}, "--role-change-interval-s")])
def test_bad_settings_name_their_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        RoleControl(**kw)


def test_window_quantile_is_of_what_the_histogram_gained():
    before = {0.1: 10, 0.5: 20, 1.0: 20, math.inf: 20}
    after = {0.1: 10, 0.5: 30, 1.0: 40, math.inf: 40}  # 10 more in (0.1, 0.5], 10 in (0.5, 1.0]
    # p50 of the 20 new ones is the top of the (0.1, 0.5] bucket; p90 interpolates inside (0.5, 1.0].
    assert window_quantile(before, after, 0.5) == pytest.approx(0.5)
    assert window_quantile(before, after, 0.9) == pytest.approx(0.5 + 0.5 * 8 / 10)
    assert window_quantile(after, after, 0.9) is None  # nothing ended
    assert window_quantile({}, {0.1: 0, math.inf: 3}, 0.9) == 0.1  # past the last bound: its lower edge


def test_worker_load_from_the_registry():
    entries = [{"role": "prefill", "stats": {"num_running": 1, "num_waiting": 3}},
               {"role": "prefill", "stats": {"num_running": 0, "num_waiting": 0}},
               {"role": "decode", "stats": {"num_running": 6}}, {"role": "decode", "stats": {}},
               {"role": "gateway"}]
    assert worker_load(entries) == (2.0, 3.0)
    assert worker_load([{"role": "decode", "stats": {"num_running": 2}}]) == (None, 2.0)
