"""Hostile and careless clients against a real stack (issue 20, points 1, 3 and 5).

* Oversized text is refused before the gateway tokenizes it: 12 MB prompts (under the 16 MiB
  message limit) once made its memory grow by gigabytes; now they are refused by their size,
  the gateway's peak memory over a burst stays within a few copies of the bytes it received
  (read from /proc, peak reset first), and after each of three bursts its memory comes back to
  within two bursts' bytes of where it started (``splitserve/gateway/memory.py``).
* Fields over the documented limits (stop strings, stop token ids, chat messages, request ids,
  token ids) are refused with INVALID_ARGUMENT before anything is admitted or reserved, while
  another client's stream runs on undisturbed.
* A request id names one request: ALREADY_EXISTS while it runs and shortly after it ended, then
  the id is free again.

Every client here is bounded: a fixed number of calls, each with a timeout, on loopback.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from transformers import AutoTokenizer

from splitserve.state.store import ID_REUSE_AFTER_S
from splitserve.common.limits import RequestLimits
from splitserve.gateway.memory import COLLECT_DELAYS_S
from tests.harness.stack import start_stack, wait_pages_at_baseline
from tests.harness.tools import memory_mib, reset_peak_memory
from splitserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(600)

# The attack: 12 MB prompts, each under the gateway's 16 MiB message limit.
HUGE_BYTES = 12_000_000
# Copies of a refused request the gateway may hold at its peak: the received bytes, the parsed
# message, the text as a Python string, plus slack for allocator rounding. Tokenizing one such
# text used to cost over 100 times its size.
COPIES_PER_REQUEST = 4
# What bursts may leave behind, in bursts' worth of bytes over the gateway's memory before the
# first, once its collections ran (settled_rss). Measured 100-176 MiB after 80 MiB bursts (1.3-2.2
# bursts; the bound of 2 failed a CI run). Part of it was free memory in the malloc arenas, which
# grew from burst to burst (six bursts: 186 ... 275 MiB settled) and once failed PILE_UP_BURSTS
# in a CI rehearsal (+89 MiB from the first burst to the third); the gateway now trims the arenas
# after each collection (splitserve/gateway/memory.py), and six bursts settled at 159-176 MiB
# (182-204 beside two busy loops). Before the gateway collected refused requests, five bursts
# left 200-500 MiB, growing from burst to burst: PILE_UP_BURSTS bounds that growth.
RETAINED_BURSTS = 3
# How much more the last burst may leave than the first: what piling up would show.
PILE_UP_BURSTS = 1
RPC_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    running = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1,
                          worker_args=["--num-threads", "1"])
    try:
        running.baseline = running.free_pages()
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def limits(stack) -> RequestLimits:
    """The limits the gateway derived (no limit flag given): the tiny model's max_model_len is 1024."""
    return RequestLimits().resolve(1024, AutoTokenizer.from_pretrained(stack.model))


def code_of(call) -> tuple[grpc.StatusCode, str]:
    """Status and details of a unary call or a whole Generate stream."""
    try:
        result = call()
        if not isinstance(result, pb.TokenizeResponse):
            list(result)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def generate(stub, request):
    return lambda: stub.Generate(request, timeout=RPC_TIMEOUT_S)


def wait_state(stack, request_id: str, wanted: str, timeout_s: float = 30.0) -> str:
    """The request's state in Redis once it is ``wanted`` (its end is written in the background),
    or whatever it is after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = stack.stub.GetRequest(pb.GetRequestRequest(request_id=request_id), timeout=10).state
        if state == wanted or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


# ---- point 1: prompt bytes ---------------------------------------------------------------------

def test_huge_text_prompts_are_refused_before_tokenizing_and_memory_stays_bounded(stack):
    text = "a" * HUGE_BYTES
    calls = [generate(stack.stub, pb.GenerateRequest(text=text, sampling=greedy(4))) for _ in range(4)]
    calls += [lambda: stack.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=RPC_TIMEOUT_S)] * 2
    calls += [generate(stack.stub, pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=text)]))]
    pid = stack.procs["gateway"].pid
    received_mib = len(calls) * HUGE_BYTES / 2**20
    before = memory_mib(pid)
    afters = []
    # Three bursts; the memory is let settle after the first and the last (each settling waits
    # out the gateway's last collection, 10 s): what two more bursts leave must come back too.
    for burst in range(3):
        # A burst's copies are counted from where it starts: the last burst's memory may still be
        # on its way back (up to RETAINED_BURSTS, below), and counting it again here made the
        # third burst's peak +338 MiB over the first burst's start in a loaded CI run.
        start = memory_mib(pid)["rss"]
        reset_peak_memory(pid)
        with ThreadPoolExecutor(len(calls)) as pool:
            answers = list(pool.map(code_of, calls))
        for code, details in answers:
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-prompt-bytes" in details, (code, details)
        peak = memory_mib(pid)["peak"]
        print(f"burst {burst + 1}: gateway RSS before {before['rss']:.0f} MiB, at the burst's start {start:.0f} MiB, "
              f"peak {peak:.0f} MiB ({received_mib:.0f} MiB received)")
        assert peak - start < COPIES_PER_REQUEST * received_mib, (burst, before, start, peak)
        if burst in (0, 2):
            after = settled_rss(pid)
            print(f"  settled: {after:.0f} MiB")
            assert after - before["rss"] < RETAINED_BURSTS * received_mib, (burst, before, after)
            afters.append(after)
    assert afters[-1] - afters[0] < PILE_UP_BURSTS * received_mib, afters  # two bursts left no more than one


def settled_rss(pid: int) -> float:
    """The process's RSS once the gateway's collections after a refusal have all run
    (splitserve/gateway/memory.py, COLLECT_DELAYS_S): the least of the second after the last.
    (Taking the first sample under a bound instead made "after" as high as the bound itself.)"""
    time.sleep(COLLECT_DELAYS_S[-1])
    samples = []
    for _ in range(10):
        time.sleep(0.1)
        samples.append(memory_mib(pid)["rss"])
    return min(samples)


def test_text_up_to_the_limit_is_served_and_one_byte_more_is_refused(stack, limits):
    # The byte tokenizer makes one token per byte: a prompt of 1000 bytes fits 1024 tokens.
    out = list(stack.stub.Generate(pb.GenerateRequest(text="b" * 1000, sampling=greedy(4)), timeout=RPC_TIMEOUT_S))
    assert out[-1].final.finish_reason == "length" and out[-1].final.usage.prompt_tokens == 1000
    code, details = code_of(generate(stack.stub, pb.GenerateRequest(text="b" * (limits.max_prompt_bytes + 1))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == (f"text is {limits.max_prompt_bytes + 1} characters; this server takes at most "
                       f"{limits.max_prompt_bytes} bytes (--max-prompt-bytes)")


# ---- point 3: fields inside the message limit --------------------------------------------------

OVERSIZED = {
    # The attack: 3 million stop token ids (3 MB on the wire) slowed every other client.
    "stop_token_ids": (pb.GenerateRequest(token_ids=[1, 2, 3], sampling=pb.SamplingParams(
        stop_token_ids=[7] * 3_000_000)), "sampling.stop_token_ids has 3000000 ids"),
    "stop count": (pb.GenerateRequest(token_ids=[1, 2, 3], sampling=pb.SamplingParams(stop=["a"] * 100_000)),
                   "sampling.stop has 100000 strings"),
    "stop length": (pb.GenerateRequest(token_ids=[1, 2, 3], sampling=pb.SamplingParams(stop=["x" * 1_000_000])),
                    "sampling.stop[0] is 1000000 characters"),
    "messages": (pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")] * 200_000),
                 "messages has 200000 entries"),
    "request_id": (pb.GenerateRequest(request_id="r" * 1_000_000, token_ids=[1, 2, 3]),
                   "request_id is 1000000 characters"),
    "token_ids": (pb.GenerateRequest(token_ids=[5] * 2_000_000), "token_ids has 2000000 tokens"),
}


def test_fields_over_their_limits_are_refused_before_any_work(stack):
    # Another client streams meanwhile: it must get every token it asked for.
    bystander: dict = {}

    def stream() -> None:
        out = list(stack.stub.Generate(pb.GenerateRequest(token_ids=[4, 8, 15], sampling=greedy(64)),
                                       timeout=RPC_TIMEOUT_S))
        bystander["final"] = out[-1].final
    thread = threading.Thread(target=stream)
    thread.start()
    for name, (request, message) in OVERSIZED.items():
        request.request_id = request.request_id or f"oversized-{name}"
        for _ in range(2):  # the attacker sent two
            code, details = code_of(generate(stack.stub, request))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(message), (name, code, details)
    thread.join(RPC_TIMEOUT_S)
    assert bystander["final"].finish_reason == "length" and bystander["final"].usage.completion_tokens == 64
    # Nothing was admitted (no record in Redis) and no page was reserved.
    for name in OVERSIZED:
        if name != "request_id":
            code, _ = code_of(lambda: stack.stub.GetRequest(
                pb.GetRequestRequest(request_id=f"oversized-{name}"), timeout=10))
            assert code == grpc.StatusCode.NOT_FOUND, name
    wait_pages_at_baseline(stack, stack.baseline)


# ---- point 5: one id, one request --------------------------------------------------------------

def test_a_request_id_names_one_request(stack):
    rid = "one-id"
    long_request = pb.GenerateRequest(request_id=rid, token_ids=[1, 2, 3], sampling=greedy(500))
    stream = stack.stub.Generate(long_request, timeout=RPC_TIMEOUT_S)
    assert next(stream).HasField("chunk")  # it runs
    code, details = code_of(generate(stack.stub, long_request))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "still running" in details, details
    stream.cancel()
    assert wait_state(stack, rid, "aborted") == "aborted"
    short_request = pb.GenerateRequest(request_id=rid, token_ids=[1, 2, 3], sampling=greedy(3))
    code, details = code_of(generate(stack.stub, short_request))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "ended moments ago" in details, details
    # As if ID_REUSE_AFTER_S had passed since the end: the check reads the record's remaining TTL.
    redis = stack.redis.client()
    key = f"{{ss}}:req:{rid}"
    redis.expire(key, redis.ttl(key) - ID_REUSE_AFTER_S)
    out = list(stack.stub.Generate(short_request, timeout=RPC_TIMEOUT_S))
    assert out[-1].final.finish_reason == "length" and out[-1].final.usage.completion_tokens == 3
    assert wait_state(stack, rid, "finished") == "finished"  # the new request's record
    assert stack.stub.GetRequest(pb.GetRequestRequest(request_id=rid), timeout=10).attempt == 1
    wait_pages_at_baseline(stack, stack.baseline)
