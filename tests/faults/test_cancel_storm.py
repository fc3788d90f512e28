"""Cancel storm: 100 concurrent requests through a real stack, each randomly run to the end,
cancelled by the client, aborted by id, or given a short deadline.

Afterwards every worker's KV pages are back at their baseline, Redis holds no live request
and nothing queued or in flight, every request's recorded state matches what its client saw,
and every token any client received is the greedy reference's (a cut-short stream is a prefix
of it). The plan (prompts, kinds, delays) is seeded by ``SEED``; the interleaving is not, so
a race may show in one run and not the next -- every problem found is listed at once.

Every one of those endings goes through the request's one ``Job.finish`` (splitserve/gateway/job.py):
whichever comes first (the workers' end, the client's cancel, the Abort, the deadline) is the
one its client sees and Redis records.
"""
from __future__ import annotations

import random
import signal
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest

from splitserve.v1 import generation_pb2
from tests.harness.stack import live_request_keys, queued_request_ids, start_stack, wait_pages_at_baseline
from tests.harness.prompts import mixed_prompts
from tests.harness.streams import wait_until

SEED = 20240611
NUM_REQUESTS = 100
KINDS = ("complete", "cancel", "abort", "deadline")
STORM_TIMEOUT_S = 240.0  # the whole storm, every stream included
SETTLE_TIMEOUT_S = 60.0  # pages and Redis after the storm
LEASE_TTL_S = 600  # decode reservations: longer than any wait, so the reaper cannot hide a leak

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    # Two of each worker kind so cancels land on every hand-off path; one torch thread each
    # (the box may have 2 cores). 128 pages of 8 tokens per worker: too few for all 100
    # requests at once, so some wait for room and are cancelled while queued.
    # A reservation lease far longer than any wait here: pages must come back because every
    # path releases them, not because the decode worker's lease reaper eventually does.
    running = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=2, decode=2,
                          worker_args=["--num-threads", "1", "--num-gpu-blocks", "128"],
                          role_args={"decode": ["--lease-ttl-s", str(LEASE_TTL_S)]})
    try:
        yield running
    finally:
        running.close()


@dataclass
class Outcome:
    kind: str
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    code: str = ""             # "OK" or the gRPC status name
    finish_reason: str = ""    # from the final message, when OK
    details: str = ""


def plan(rng: random.Random) -> list[dict]:
    prompts = mixed_prompts(NUM_REQUESTS, seed=SEED, lo=3, hi=70)
    out = []
    for i, prompt in enumerate(prompts):
        kind = rng.choice(KINDS)
        out.append({
            "id": f"storm-{i}", "kind": kind, "prompt": prompt,
            "max_tokens": rng.randint(1, 24) if kind == "complete" else rng.randint(20, 300),
            "start_s": rng.uniform(0.0, 1.5),
            "cut_s": rng.uniform(0.0, 1.2),  # cancel / abort delay, or the deadline
            "priority": rng.randint(-2, 2),
            "interval": rng.choice((0, 1, 3)),
        })
    return out


def run_one(stub, item: dict, outcome: Outcome) -> None:
    time.sleep(item["start_s"])
    request = generation_pb2.GenerateRequest(
        request_id=item["id"], token_ids=item["prompt"], priority=item["priority"],
        stream_interval=item["interval"],
        sampling=generation_pb2.SamplingParams(max_tokens=item["max_tokens"], temperature=0.0, ignore_eos=True))
    timeout = item["cut_s"] + 0.05 if item["kind"] == "deadline" else 120.0
    call = stub.Generate(request, timeout=timeout)
    timer = None
    if item["kind"] == "cancel":
        timer = threading.Timer(item["cut_s"], call.cancel)
    elif item["kind"] == "abort":
        timer = threading.Timer(item["cut_s"], lambda: stub.Abort(
            generation_pb2.AbortRequest(request_id=item["id"]), timeout=10))
    if timer is not None:
        timer.start()
    try:
        for response in call:
            if response.HasField("chunk"):
                outcome.tokens += response.chunk.token_ids
            else:
                outcome.finish_reason = response.final.finish_reason
        outcome.code = "OK"
    except grpc.RpcError as e:
        outcome.code, outcome.details = e.code().name, e.details() or ""
    finally:
        if timer is not None:
            timer.join(15)


def test_cancel_storm_leaves_no_pages_and_no_live_requests(stack, hf_reference):
    baseline = stack.free_pages()
    rng = random.Random(SEED)
    items = plan(rng)
    outcomes = {item["id"]: Outcome(item["kind"], item["prompt"], item["max_tokens"]) for item in items}
    threads = [threading.Thread(target=run_one, args=(stack.stub, item, outcomes[item["id"]]), daemon=True)
               for item in items]
    for t in threads:
        t.start()
    give_up = time.monotonic() + STORM_TIMEOUT_S
    for t in threads:
        t.join(max(0.0, give_up - time.monotonic()))
    hung = [item["id"] for item, t in zip(items, threads) if t.is_alive()]
    assert not hung, f"streams still open after {STORM_TIMEOUT_S:.0f} s: {hung}"

    by_code: dict[str, int] = {}
    for o in outcomes.values():
        by_code[f"{o.kind}:{o.code}"] = by_code.get(f"{o.kind}:{o.code}", 0) + 1
    print("outcomes:", dict(sorted(by_code.items())))

    # Every check runs and every problem is reported together: one run shows the whole picture.
    problems: list[str] = []

    # 1. Every client saw an allowed ending for what it did.
    allowed = {"complete": {"OK"}, "cancel": {"OK", "CANCELLED"}, "abort": {"OK", "CANCELLED"},
               "deadline": {"OK", "DEADLINE_EXCEEDED"}}
    for rid, o in outcomes.items():
        if o.code not in allowed[o.kind]:
            problems.append(f"{rid} ({o.kind}): client saw {o.code} {o.details!r} after {len(o.tokens)} tokens")
        elif o.code == "OK" and (o.finish_reason != "length" or len(o.tokens) != o.max_tokens):
            problems.append(f"{rid} ({o.kind}): OK with {o.finish_reason!r} after {len(o.tokens)}/{o.max_tokens}")
    # The storm really stormed: each way of ending happened.
    codes = {o.code for o in outcomes.values()}
    assert {"OK", "CANCELLED", "DEADLINE_EXCEEDED"} <= codes, by_code

    # 2. Pages back at baseline on every worker; Redis holds nothing live or queued.
    try:
        wait_pages_at_baseline(stack, baseline, timeout_s=SETTLE_TIMEOUT_S)
    except AssertionError as e:
        problems.append(str(e))
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        live, queues = live_request_keys(stack.redis), queued_request_ids(stack.redis)
        if not live and not queues["pending"] and not queues["inflight"]:
            break
        time.sleep(0.2)
    if live:
        problems.append(f"request hashes without a terminal state: {live}")
    if queues != {"pending": [], "inflight": []}:
        problems.append(f"still queued: {queues}")

    # 3. Each request's recorded state agrees with what its client saw. A request the gateway
    #    never admitted (cancelled or out of time before it arrived) is unknown.
    expected_states = {"OK": {"finished"}, "CANCELLED": {"aborted", "finished", None},
                       "DEADLINE_EXCEEDED": {"deadline", "finished", None}}
    for rid, o in outcomes.items():
        try:
            info = stack.stub.GetRequest(generation_pb2.GetRequestRequest(request_id=rid), timeout=10)
            state, recorded = info.state, f"{info.state} ({info.finish_reason}: {info.error!r})"
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                problems.append(f"{rid}: GetRequest gave {e.code().name} {e.details()!r}")
                continue
            state, recorded = None, "unknown"
        if state not in expected_states.get(o.code, set()):
            problems.append(f"{rid} ({o.kind}): client saw {o.code} after {len(o.tokens)} tokens, "
                            f"Redis recorded {recorded}")

    # 4. Every token streamed is the greedy reference's, also for streams cut short.
    ref = hf_reference(stack.model)
    for rid, o in outcomes.items():
        if o.tokens and o.tokens != ref.greedy(o.prompt, len(o.tokens)):
            problems.append(f"{rid} ({o.kind}, {o.code}): tokens differ from the greedy reference")

    # 5. And the stack still serves.
    tail = list(stack.stub.Generate(generation_pb2.GenerateRequest(
        token_ids=[1, 2, 3], sampling=generation_pb2.SamplingParams(max_tokens=3, temperature=0.0,
                                                                    ignore_eos=True)), timeout=60))
    assert tail[-1].final.finish_reason == "length"
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


def test_a_deadline_during_prefill_frees_the_decode_reservation(stack):
    """The prefill workers are frozen (SIGSTOP), so the request's deadline passes while its
    Prefill call waits, after the decode worker reserved pages for it: those pages must come
    back at once (the lease of this stack is 10 minutes)."""
    baseline = stack.free_pages()
    decodes = stack.names("decode")
    prefills = stack.names("prefill")
    request = generation_pb2.GenerateRequest(
        request_id="deadline-in-prefill", token_ids=mixed_prompts(1, seed=SEED + 1, lo=40, hi=40)[0],
        sampling=generation_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for name in prefills:
        stack.kill(name, signal.SIGSTOP)
    try:
        # Sent at once: the frozen workers' registrations (3 s heartbeat TTL) are still live.
        with pytest.raises(grpc.RpcError) as err:
            list(stack.stub.Generate(request, timeout=1.5))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
        wait_pages_at_baseline(stack, baseline, timeout_s=10, names=decodes)
    finally:
        for name in prefills:
            stack.kill(name, signal.SIGCONT)
    wait_pages_at_baseline(stack, baseline, timeout_s=SETTLE_TIMEOUT_S)


def test_a_request_the_prefill_worker_refuses_frees_its_decode_pages(tiny_model_dirs, tmp_path_factory):
    """The prefill worker's pool is too small for the prompt, so it refuses the request after
    the decode worker reserved pages for it: those pages must come back at once, not when
    the reservation's lease runs out."""
    refusing = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1,
                           worker_args=["--num-threads", "1"],
                           role_args={"prefill": ["--num-gpu-blocks", "4", "--max-num-batched-tokens", "32"],
                                      "decode": ["--lease-ttl-s", str(LEASE_TTL_S)]})
    try:
        baseline = refusing.free_pages()
        request = generation_pb2.GenerateRequest(
            request_id="too-big-for-prefill", token_ids=mixed_prompts(1, seed=SEED, lo=60, hi=60)[0],
            sampling=generation_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        with pytest.raises(grpc.RpcError) as err:
            list(refusing.stub.Generate(request, timeout=60))
        answer = f"{err.value.code().name}: {err.value.details()}"
        assert err.value.code() != grpc.StatusCode.INTERNAL, answer
        try:
            wait_pages_at_baseline(refusing, baseline, timeout_s=10)
        except AssertionError as e:
            raise AssertionError(f"after the client got {answer!r}: {e}") from None
        # The gateway records a request's end in the background, after the client has its answer
        # (splitserve/gateway/ledger.py, record_end): under load it lands a moment later.
        def state() -> str:
            return refusing.stub.GetRequest(generation_pb2.GetRequestRequest(request_id="too-big-for-prefill"),
                                            timeout=10).state
        wait_until(lambda: state() != "prefilling", 30, "the request's end to be recorded")
        assert state() == "failed"
        assert live_request_keys(refusing.redis) == []
    finally:
        refusing.close()
