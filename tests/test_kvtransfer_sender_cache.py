"""The prefill side's senders: a broken one is rebuilt, one whose decode pool is gone is closed,
and only so many are kept (issue 36, point 8). Real receivers, real sockets and shm pools."""
import gc
import socket
import weakref

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kvtransfer import prefill_side
from splitserve.worker.wiring import build_decode, build_prefill
from tests.test_kvtransfer_handoff import handoff

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(3, 30))


def config(model):
    return EngineConfig(model=str(model), dtype="float32", enforce_eager=True, num_gpu_blocks=64, block_size=8)


@pytest.fixture
def workers(tiny_model_dirs, private_shm):
    made = []

    def make(kind, transport=None):
        worker = build_decode(config(tiny_model_dirs["llama"]), transport) if kind == "decode" else \
            build_prefill(config(tiny_model_dirs["llama"]))
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.close()


def test_a_broken_tcp_sender_is_replaced_for_the_next_request(workers, llama_reference):
    decode, prefill = workers("decode", "tcp"), workers("prefill")
    [out], _ = handoff(prefill, decode, [PROMPT], GREEDY, tag="ok")
    assert out.token_ids == llama_reference.greedy(PROMPT, 4)
    [(key, sender)] = prefill._senders.items()
    sender.sock.shutdown(socket.SHUT_RDWR)  # the connection breaks (a reset, a restarted peer)
    desc = decode.reserve("lost", len(PROMPT))
    prefill.start("lost", PROMPT, GREEDY, desc)
    [result] = prefill.step()
    assert result.error is not None  # this transfer is lost, and says so...
    decode.abort("lost")
    assert key not in prefill._senders and not sender.usable()
    # ... but not the next ones: a new connection carries them.
    [out], _ = handoff(prefill, decode, [PROMPT], GREEDY, tag="after")
    assert out.token_ids == llama_reference.greedy(PROMPT, 4)
    assert prefill._senders[key] is not sender
    decode.engine.assert_idle()


def test_a_gone_decode_pool_is_not_kept_mapped(workers, llama_reference):
    prefill = workers("prefill")
    first = workers("decode", "shm")
    handoff(prefill, first, [PROMPT], GREEDY, tag="a")
    [old] = prefill._senders.values()
    mapping = weakref.ref(old.dst_pool)  # the sender's mapping of that decode pool
    first.close()  # the decode worker stops: its pool directory is removed
    second = workers("decode", "shm")
    [out], _ = handoff(prefill, second, [PROMPT], GREEDY, tag="b")
    assert out.token_ids == llama_reference.greedy(PROMPT, 4)
    assert [s.address for s in prefill._senders.values()] == [second.receivers[0].address]
    assert old.dst_pool is None and not prefill._retired
    gc.collect()
    assert mapping() is None  # unmapped: the pool's memory is not held by this side any more


def test_only_so_many_senders_are_kept(workers, llama_reference, monkeypatch):
    monkeypatch.setattr(prefill_side, "MAX_SENDERS", 1)
    prefill = workers("prefill")
    one, two = workers("decode", "shm"), workers("decode", "shm")
    handoff(prefill, one, [PROMPT], GREEDY, tag="a")
    [first] = prefill._senders.values()
    handoff(prefill, two, [PROMPT], GREEDY, tag="b")
    assert [s.address for s in prefill._senders.values()] == [two.receivers[0].address]
    assert first.dst_pool is None  # closed, unmapped
    [out], _ = handoff(prefill, one, [PROMPT], GREEDY, tag="c")  # and opened again when needed
    assert out.token_ids == llama_reference.greedy(PROMPT, 4)


def test_a_new_pool_sweeps_the_pools_dead_processes_left(private_shm, workers):
    """A decode worker killed with nobody to reap it (no supervisor, a container restarted) leaves
    its pool behind; the next pool made in that pid namespace removes it. Pools of live processes,
    of another namespace, or without metadata are left alone."""
    import json
    import os
    import subprocess
    import sys

    from splitserve.common.locality import pid_namespace
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()

    def pool(pid, namespace, meta=True):
        directory = private_shm / f"splitserve-kv-{pid}-{os.urandom(4).hex()}"
        directory.mkdir(mode=0o700)
        (directory / "pool").write_bytes(bytes(4096))
        if meta:
            (directory / "meta.json").write_text(json.dumps({"shape": [1] * 6, "dtype": "float32",
                                                             "pid_namespace": namespace}))
        return directory

    dead = pool(gone.pid, pid_namespace())
    kept = [pool(os.getpid(), pid_namespace()), pool(gone.pid, "pid:[1]"), pool(gone.pid, "", meta=False)]
    decode = workers("decode", "shm")
    assert not dead.exists()
    assert all(directory.exists() for directory in kept)
    assert os.path.isdir(decode.receivers[0].address)
