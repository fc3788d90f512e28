"""Tensor-parallel workers served for real: a TP=2 prefill worker hands off to TP=2 decode workers,
and a TP=2 colocated worker serves on its own.

Greedy output through the gateway equals transformers; a decode worker's rank 1 killed while
it streams ends that worker with a non-zero exit (its rank 0 and every rank process gone, its
shared-memory pools removed) and the gateway finishes its requests on the other decode worker,
token for token; the live workers' pages return to their baseline.
"""
import os
from pathlib import Path

import pytest

from tests.harness.prompts import mixed_prompts
from tests.harness.stack import start_stack, wait_pages_at_baseline
from tests.harness.streams import assert_all_match, join_all, run_streams, wait_until


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    with start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=2,
                     worker_args=["--tensor-parallel-size", "2", "--max-num-batched-tokens", "32"]) as st:
        yield st


def ranks_of(pid: int) -> list[int]:
    """The tensor-parallel rank processes a worker started (its children running a worker's rank
    program: splitserve.worker.tp_follower for a worker that hands KV over, the engine's own
    splitserve.engine.tp_follower for a colocated one)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b".tp_follower" in Path(f"/proc/{c}/cmdline").read_bytes()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is not running either.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_colocated_worker_runs_two_ranks_and_the_output_is_exact(tiny_model_dirs, tmp_path_factory, reference):
    """`decode --role both --tensor-parallel-size 2`: one colocated worker of two ranks serves
    transformers' greedy tokens (first in this file: its stack is gone before the module's starts)."""
    with start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=0, decode=0, both=1,
                     worker_args=["--tensor-parallel-size", "2", "--max-num-batched-tokens", "32"]) as st:
        [name] = st.names("both")
        assert len(ranks_of(st.procs[name].pid)) == 1, "the colocated worker should have started rank 1"
        streams = run_streams(st, "tp-both", mixed_prompts(6, seed=23, lo=5, hi=90), max_tokens=12)
        join_all(streams)
        assert_all_match(streams, reference)


def test_a_one_rank_prefill_worker_hands_off_to_a_two_rank_decode_worker(tiny_model_dirs, tmp_path_factory,
                                                                         reference):
    """`up --prefill-tensor-parallel-size 1 --decode-tensor-parallel-size 2` as up runs it (each
    worker's own --tensor-parallel-size): the prefill worker's KV is re-sharded by head into the
    decode worker's two ranks over shm; transformers' tokens, and every page back."""
    with start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1,
                     worker_args=["--max-num-batched-tokens", "32"],
                     role_args={"prefill": ["--tensor-parallel-size", "1"],
                                "decode": ["--tensor-parallel-size", "2"]}) as st:
        assert len(ranks_of(st.procs[st.names("decode")[0]].pid)) == 1
        assert not ranks_of(st.procs[st.names("prefill")[0]].pid)
        baseline = st.free_pages()
        streams = run_streams(st, "tp-1to2", mixed_prompts(4, seed=24, lo=5, hi=90), max_tokens=8)
        join_all(streams)
        assert_all_match(streams, reference)
        wait_pages_at_baseline(st, baseline)


def test_every_worker_runs_two_ranks_and_the_output_is_exact(stack, reference):
    for name in stack.roles:
        assert len(ranks_of(stack.procs[name].pid)) == 1, f"{name} should have started rank 1"
    prompts = mixed_prompts(8, seed=21, lo=5, hi=90)  # up to 3 chunks of 32 tokens: pages over several steps
    streams = run_streams(stack, "tp-exact", prompts, max_tokens=12)
    join_all(streams)
    assert_all_match(streams, reference)


def test_a_decode_rank_killed_mid_stream_ends_its_worker_and_the_gateway_retries_elsewhere(stack, reference,
                                                                                           baseline):
    victim = stack.names("decode")[0]
    worker = stack.procs[victim]
    [rank1] = ranks_of(worker.pid)
    streams = run_streams(stack, "tp-kill", mixed_prompts(8, seed=22, lo=5, hi=40), max_tokens=200)
    wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), 90, "every stream to be decoding")
    os.kill(rank1, 9)
    assert worker.wait(30) == 1  # the worker exits non-zero for its supervisor; nothing hangs
    join_all(streams)
    assert_all_match(streams, reference)
    assert sum(s.attempts() - 1 for s in streams) >= 1, "no request was decoding on the killed worker"
    assert not alive(rank1)
    for pid in (worker.pid, rank1):  # pool directories are named by the process that made them
        assert not list(Path("/dev/shm").glob(f"splitserve-kv-{pid}-*")), f"pools of pid {pid} were left"
    survivors = [n for n in baseline if n != victim]
    wait_pages_at_baseline(stack, {n: baseline[n] for n in survivors}, names=survivors)
    stack.restart(victim)
    assert len(ranks_of(stack.procs[victim].pid)) == 1
