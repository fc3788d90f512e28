"""Tensor parallelism on CPU (gloo): two ranks per engine give transformers' greedy tokens.

Colocated (eager and compiled, Llama and Qwen2 with its q/k/v biases, swap preemption) and
disaggregated (a TP=2 prefill engine writing into a TP=2 decode engine over shm and tcp: rank r
into rank r; pairs split differently: tests/test_kv_reshard.py); a split that does not divide the
heads is refused before anything runs; a rank that dies fails
the engine's next step at once instead of hanging it, and the step it dies in; a worker (rank 0)
that is killed takes its other ranks with it, in a step or between steps. The served path
(workers, gateway retry) is in tests/faults/test_tensor_parallel_service.py.
"""
import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from splitserve.engine import EngineConfig, SamplingParams
from splitserve.engine.tensor_parallel.ranks import RankDied
from splitserve.worker.wiring import build_decode, build_prefill
from tests.harness.tiny_models import make_tiny_model
from tests.test_engine_correctness import mixed_prompts
from tests.test_kvtransfer_handoff import handoff

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def engines():
    """Closes every engine (and so its other ranks) the test built; checks none is left running."""
    made = []
    yield made
    for engine in made:
        engine.close()
    for engine in made:
        followers = engine.runner.followers
        if followers is not None:
            assert all(p.poll() is not None for p in followers.procs), "a tensor-parallel rank outlived its engine"


def llm(model, engines, **kw):
    from splitserve.engine import LLM
    kw.setdefault("dtype", "float32")
    kw.setdefault("enforce_eager", True)
    kw.setdefault("num_gpu_blocks", 64)
    made = LLM(model=str(model), **kw)
    engines.append(made.engine)
    return made


# The compiled step once (its sharded graph is the same code for every family; each rank compiles
# its own, the suite's costliest few seconds of this module), eager for both families.
@pytest.mark.parametrize("arch,mode", [("llama", "eager"), ("llama", "compiled"), ("qwen2", "eager")])
def test_two_ranks_give_the_tokens_of_one_rank_and_of_transformers(arch, mode, tiny_model_dirs, hf_reference, engines):
    """A mixed batch (1-60-token prompts, decoding together) on TP=2 and TP=1; the tiny models
    have 4 attention heads over 2 KV heads (GQA): one KV head per rank."""
    model = tiny_model_dirs[arch]
    step_mode = {"enforce_eager": mode == "eager"}
    prompts = mixed_prompts(6, seed=5)
    two = llm(model, engines, tensor_parallel_size=2, **step_mode)
    assert two.engine.runner.num_kv_heads == 1 and two.engine.runner.kv_cache.shape[4] == 1
    got = [o.token_ids for o in two.generate(prompts, GREEDY)]
    one = llm(model, engines, **step_mode)
    assert got == [o.token_ids for o in one.generate(prompts, GREEDY)]
    ref = hf_reference(model)
    assert got == [ref.greedy(p, 8) for p in prompts]


def test_the_ranks_rendezvous_listens_on_loopback_only(tiny_model_dirs, engines):
    """The ranks meet through a TCPStore on rank 0, which has no authentication: it listens on
    127.0.0.1, not on every interface as torch's own would (issue 36, point 7)."""
    import psutil
    me = psutil.Process()

    def listening() -> set:
        return {c.laddr for proc in (me, *me.children(recursive=True))
                for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}

    before = listening()  # (another test's servers in this process are not this engine's)
    llm(tiny_model_dirs["llama"], engines, tensor_parallel_size=2)
    opened = listening() - before
    assert opened and {addr.ip for addr in opened} == {"127.0.0.1"}, opened


def test_swap_preemption_moves_every_ranks_pages(tiny_model_dirs, hf_reference, engines):
    """Few pages: sequences are swapped out and back in; each rank swaps its own slice."""
    model = tiny_model_dirs["llama"]
    two = llm(model, engines, tensor_parallel_size=2, num_gpu_blocks=12, block_size=8,
              preemption_mode="swap", num_cpu_blocks=64)
    prompts = mixed_prompts(6, seed=9, lo=20, hi=40)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = two.generate(prompts, params)
    assert two.engine.scheduler.num_preemptions > 0
    ref = hf_reference(model)
    assert [o.token_ids for o in outputs] == [ref.greedy(p, 24) for p in prompts]


def test_a_split_that_does_not_divide_the_heads_is_refused_before_any_rank_starts(tmp_path, engines, monkeypatch):
    """6 attention heads over 3 KV heads at TP=2 (the query heads would split, the KV heads not);
    6 over 2 at TP=4 (neither): the whole message, and no rank process was started for it."""
    import re

    from splitserve.engine.tensor_parallel import ranks

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started for a split that cannot work")
    monkeypatch.setattr(ranks, "FollowerRanks", no_ranks)
    three = make_tiny_model(tmp_path / "three-kv-heads", num_heads=6, num_kv_heads=3)
    message = ("tensor_parallel_size 2 does not divide this model's 3 KV heads (it has 6 attention heads and 3 KV "
               "heads): pick a size that divides both, e.g. 1, 3")
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        llm(three, engines, tensor_parallel_size=2)
    two = make_tiny_model(tmp_path / "two-kv-heads", num_heads=6, num_kv_heads=2)
    with pytest.raises(ValueError, match=re.escape("tensor_parallel_size 4 does not divide this model's 6 attention "
                                                   "heads, 2 KV heads (") + ".*e\\.g\\. 1, 2$"):
        llm(two, engines, tensor_parallel_size=4)
    assert not engines  # no engine was built


def config(model, **kw):
    kw.setdefault("num_gpu_blocks", 96)
    kw.setdefault("enforce_eager", True)
    kw.setdefault("block_size", 8)
    return EngineConfig(model=str(model), dtype="float32", **kw)


@contextlib.contextmanager
def connected(decode_config, transport, prefill_config, **prefill_kw):
    """A prefill and a decode connector (and their engines' ranks), closed at the end."""
    decode = build_decode(decode_config, transport)
    prefill = build_prefill(prefill_config, **prefill_kw)
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()
        prefill.engine.close()
        decode.engine.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_tp2_prefill_engine_hands_off_to_a_tp2_decode_engine(transport, tiny_model_dirs, hf_reference, private_shm):
    """Rank r of the prefill engine writes its KV head into rank r of the decode engine: the
    decode side's output equals transformers only if both ranks' pages arrived (rank 1's
    attention reads only what rank 1 of the prefill side sent). Chunked prefill ships pages over
    several steps; the pages are on the decode ranks byte for byte."""
    model = tiny_model_dirs["llama"]
    with connected(config(model, tensor_parallel_size=2), transport,
                   config(model, tensor_parallel_size=2, max_num_batched_tokens=24), verify_checksum=True) as (prefill, decode):
        desc = decode.reserve("probe", 4)
        assert desc.layout.tensor_parallel_size == 2 and desc.layout.num_kv_heads == 1
        assert [t for t, _ in desc.rank_offers[0]] == [t for t, _ in desc.offers]
        assert dict(desc.rank_offers[0])[transport] != desc.address  # rank 1 has a receiver of its own
        decode.abort("probe")
        prompts = mixed_prompts(5, seed=11, lo=3, hi=45)
        outputs, _ = handoff(prefill, decode, prompts)
        ref = hf_reference(model)
        assert [o.token_ids for o in outputs] == [ref.greedy(p, 8) for p in prompts]
        prefill.engine.assert_idle()
        decode.engine.assert_idle()
        assert len(decode.leases) == 0
    assert not list(private_shm.iterdir())  # every rank's shared pool (and the page owners) removed


def test_a_rank_that_dies_fails_the_next_step_at_once_and_the_engine_reports_it(tiny_model_dirs, engines):
    """SIGKILL rank 1 between steps: the next step raises (a dead rank, or gloo's closed
    connection) within seconds, not after a collective timeout; closing stops what is left."""
    two = llm(tiny_model_dirs["llama"], engines, tensor_parallel_size=2)
    engine = two.engine
    engine.add_request("a", list(range(1, 30)), GREEDY)
    engine.step()
    died: list[BaseException] = []
    engine.runner.followers.on_death(died.append)
    rank1 = engine.runner.followers.procs[0]
    os.kill(rank1.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises((RankDied, RuntimeError)):
        for _ in range(50):  # the watcher may or may not have seen the death before the step
            engine.step()
            time.sleep(0.2)
    assert time.monotonic() - start < 30
    deadline = time.monotonic() + 10
    while not died and time.monotonic() < deadline:
        time.sleep(0.1)
    assert died and "rank 1" in str(died[0])
    engine.abort_request("a")


def test_a_rank_killed_while_rank_0_waits_for_it_inside_a_step_fails_that_step(tiny_model_dirs, engines):
    """Mid-step for certain: rank 1 is stopped, rank 0 starts a step and reaches its first
    all-reduce (where it waits for rank 1's partial sum), then rank 1 is killed. That step raises
    within seconds instead of waiting out the all-reduce's timeout, and so does the next one."""
    from splitserve.engine.tensor_parallel import shard
    two = llm(tiny_model_dirs["llama"], engines, tensor_parallel_size=2)
    engine, runner = two.engine, two.engine.runner
    engine.add_request("a", list(range(1, 30)), GREEDY)
    engine.step()
    rank1 = runner.followers.procs[0]
    reduce = shard._groups[runner.tp_group_id]
    entered = threading.Event()
    shard._groups[runner.tp_group_id] = lambda x: entered.set() or reduce(x)
    failure: list[BaseException] = []

    def step():
        try:
            engine.step()
        except BaseException as e:  # handed to the test's thread
            failure.append(e)
    os.kill(rank1.pid, signal.SIGSTOP)
    stepping = threading.Thread(target=step)
    try:
        stepping.start()
        assert entered.wait(30), "rank 0's step never reached an all-reduce"
        stepping.join(1.0)
        assert stepping.is_alive(), "rank 0 did not wait for the stopped rank"
        os.kill(rank1.pid, signal.SIGKILL)
        stepping.join(20)  # well short of the all-reduce's own timeout
        assert not stepping.is_alive(), "the step still waits for a dead rank"
    finally:
        if rank1.poll() is None:
            os.kill(rank1.pid, signal.SIGKILL)
        if stepping.is_alive():  # a failed check: wake the step rather than wait out the all-reduce's timeout
            runner.followers.all_reduce.abort()
        stepping.join(60)
    [error] = failure
    assert isinstance(error, RuntimeError) and ("died" in str(error) or "rank 1" in str(error)), error
    with pytest.raises(RankDied, match="rank 1"):
        engine.step()
    engine.abort_request("a")


RANK_0_THAT_HANGS = """
import sys, time
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.tensor_parallel import shard
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, num_gpu_blocks=64, tensor_parallel_size=2)
runner = llm.engine.runner

def hang(x=None):  # in a step: rank 0 stops inside its first all-reduce, before adding its partial sum
    print("ready", runner.followers.procs[0].pid, runner.followers.shm_path, flush=True)
    time.sleep(3600)
if sys.argv[2] == "idle":
    hang()
shard._groups[runner.tp_group_id] = hang
llm.generate([list(range(1, 30))], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
"""


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"  # a zombie has exited


@pytest.mark.parametrize("when", ["mid-step", "idle"])
def test_rank_0_killed_takes_the_other_ranks_with_it(when, tiny_model_dirs, private_shm):
    """The worker process (rank 0) is SIGKILLed while rank 1 waits for it inside a step's
    all-reduce (mid-step), or for its next step (idle): rank 1 exits on its own within seconds (no
    rank left running without its worker) and removes what it made in shared memory, and the
    all-reduce file of the dead rank 0 too."""
    import select
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-c", RANK_0_THAT_HANGS, str(tiny_model_dirs["llama"]), when], cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.PIPE, text=True)
    rank1 = None
    try:
        line, deadline = [], time.monotonic() + 300
        while not line and proc.poll() is None and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                text = proc.stdout.readline()
                line = text.split() if text.startswith("ready") else []
        assert line, f"rank 0 did not get ready (exit {proc.poll()})"
        rank1, shm_path = int(line[1]), Path(line[2])
        time.sleep(1.0)  # rank 1 is waiting in the same all-reduce (mid-step) or for a message (idle)
        assert _running(rank1) and shm_path.exists()
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 30
        while _running(rank1) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(rank1), "rank 1 outlived its worker"
        assert not list(private_shm.glob(f"splitserve-kv-{rank1}-*")), "rank 1's pool was left"
        assert not shm_path.exists(), "the all-reduce file of the dead worker was left"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if rank1 is not None and _running(rank1):
            os.kill(rank1, signal.SIGKILL)


def test_a_transfer_that_fails_on_rank_1_alone_fails_and_frees_its_pages(tiny_model_dirs):
    """Rank 0's pages land but rank 1 cannot reach its decode rank (its offer points nowhere):
    rank 1 reports it, the transfer fails with rank 1's reason instead of completing with half the
    KV, and both sides give every page back."""
    import dataclasses
    model = tiny_model_dirs["llama"]
    with connected(config(model, tensor_parallel_size=2), "shm",
                   config(model, tensor_parallel_size=2, max_num_batched_tokens=24)) as (prefill, decode):
        desc = decode.reserve("r0", 40)
        broken = dataclasses.replace(desc, rank_offers=((("shm", "/nonexistent/splitserve-kv"),),))
        prefill.start("r0", list(range(1, 41)), GREEDY, broken)
        results = []
        for _ in range(20):
            results += prefill.step()
            if results:
                break
        [result] = results
        assert result.error is not None and "tensor-parallel rank 1" in str(result.error)
        assert result.first_token is None
        assert decode.abort("r0")
        prefill.engine.assert_idle()
        decode.engine.assert_idle()


def test_control_messages_cross_a_socket_without_pickle():
    """A step message (tensors of several dtypes, an empty one, a descriptor with rank offers, page
    runs) and a KV setup come back equal; a frame naming any other type is refused, not built."""
    import json
    import socket

    from splitserve.engine.attention import StepLayout
    from splitserve.engine.tensor_parallel import messages
    from splitserve.kvtransfer.base import KVLayout, TransferDescriptor
    from splitserve.kvtransfer.tensor_parallel import CopyOrder, KVSetup
    layout = StepLayout(slot_mapping=torch.arange(5), query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
                        seq_lens=torch.tensor([9, 3], dtype=torch.int32), block_tables=torch.zeros((2, 0), dtype=torch.int32),
                        num_decodes=1, query_lens_list=[2, 3], seq_lens_list=[9, 3], block_size=8)
    desc = TransferDescriptor("r0", "shm", "/dev/shm/a", (3, 4), KVLayout("m", 2, 1, 16, 8, "float32", tensor_parallel_size=2),
                              7, 123.5, (("tcp", "h:1"),), rank_offers=((("shm", "/dev/shm/b"), ("tcp", "h:2")),))
    step = messages.StepMessage(swap_out=((1, 2),), input_ids=torch.tensor([1, 2, 3, 4, 5]),
                                positions=torch.arange(5).to(torch.bfloat16), layout=layout,
                                kv_orders=(CopyOrder(desc, "shm", ((0, 3, 2),)),))
    setup = KVSetup("serve", ("shm", "tcp"), "/dev/shm/o", kv_key=b"\x00secret")
    a, b = socket.socketpair()
    with a, b:
        for sent in (step, setup, {"r0": "why"}, None):
            messages.send(a, sent)
            got = messages.recv(b)
            if isinstance(sent, messages.StepMessage):
                assert torch.equal(got.input_ids, sent.input_ids) and got.positions.dtype == torch.bfloat16
                assert torch.equal(got.layout.query_start_loc, layout.query_start_loc)
                assert got.layout.block_tables.shape == (2, 0) and got.layout.query_lens_list == [2, 3]
                assert got.kv_orders == sent.kv_orders and got.swap_out == ((1, 2),) and got.wants_reply
            else:
                assert got == sent
        doc = json.dumps({"type": "Popen", "fields": {"args": ["sh"]}}).encode()
        a.sendall(len(doc).to_bytes(8, "big") + doc)
        with pytest.raises(KeyError):
            messages.recv(b)
