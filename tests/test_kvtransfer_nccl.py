"""nccl transport: torch.distributed point-to-point, run here with gloo on CPU pools.

The decode side (receiver, leases, pool) lives in the test process; the prefill side runs in a
child process (``python -c`` calling ``_child`` below), which rebuilds its source pool from a
seed, sends the runs, flushes and writes what happened to a JSON result file.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from splitserve.kvtransfer.base import (KVLayout, LayoutMismatchError, TransferAbortedError, TransferDescriptor, TransferError,
                             coalesce)
from splitserve.kvtransfer.lease import LeaseTable, PageFence
from splitserve.kvtransfer.transports.nccl import NcclReceiver, NcclSender
from tests.kv_pools import QUANTIZED, random_pool

ROOT = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM, BLOCKS = 2, 8, 24
FRAGMENTED = ([5, 2, 9, 11, 0], [3, 7, 8, 15, 20])
CONTIGUOUS = ([10, 11, 12, 13, 14, 15], [9, 10, 11, 12, 13, 14])
FEW_RUNS = ([20, 21, 3], [0, 1, 2])  # 2 runs: one WRITE frame each; FRAGMENTED (5 runs) goes PACKED


def make_pool(layers: int, block_size: int, dtype: str, seed: int, device: str = "cpu",
              heads: int = HEADS, head_dim: int = HEAD_DIM) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return random_pool((layers, 2, BLOCKS, block_size, heads, head_dim), dtype, gen).to(device)


class _DyingGroup:
    """Stands in for the sender's data group and SIGKILLs the process at the n-th payload send."""

    def __init__(self, group, at: int):
        self.group, self.at, self.sends = group, at, 0

    def send(self, tensors, dst, tag):
        self.sends += 1
        if self.sends == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.group.send(tensors, dst, tag)

    def __getattr__(self, name):
        return getattr(self.group, name)


def _child(spec_path: str) -> None:
    """Prefill side: one sender per decode address, every job written layer by layer, then flushed."""
    spec = json.loads(Path(spec_path).read_text())
    senders: dict[str, NcclSender] = {}
    results = []
    for job in spec["jobs"]:
        desc = TransferDescriptor.from_dict(job["desc"])
        if desc.address not in senders:
            src = make_pool(*job["pool"])
            senders[desc.address] = NcclSender(desc.address, src, timeout_s=10)
        sender = senders[desc.address]
        if job.get("kill_at_data_send"):
            sender._data = _DyingGroup(sender._data, job["kill_at_data_send"])
        copies, sent = sender.num_copies, sender.bytes_sent
        runs = coalesce(job["src_blocks"], desc.block_ids)
        try:
            for layer in range(desc.layout.num_layers):
                sender.write(desc, layer, runs)
            sender.flush(desc)
            results.append({"result": "ok", "copies": sender.num_copies - copies, "bytes": sender.bytes_sent - sent})
        except TransferError as e:
            results.append({"result": type(e).__name__, "message": str(e)})
    for sender in senders.values():
        sender.close()
    Path(spec["out"]).write_text(json.dumps(results))


def run_child(jobs: list[dict], tmp_path: Path, timeout: float = 40) -> tuple[int, list[dict] | None]:
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    out.unlink(missing_ok=True)
    spec.write_text(json.dumps({"jobs": jobs, "out": str(out)}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    code = "import sys; from tests.test_kvtransfer_nccl import _child; _child(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(spec)], cwd=ROOT, env=env, timeout=timeout,
                          capture_output=True, text=True)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"sender process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.returncode, json.loads(out.read_text()) if out.exists() else None


class Decode:
    """A decode worker's side: pool, leases and receiver."""

    def __init__(self, layers: int, block_size: int, dtype: str, seed: int, device: str = "cpu",
                 timeout_s: float = 10, heads: int = HEADS, head_dim: int = HEAD_DIM):
        self.pool = make_pool(layers, block_size, dtype, seed, device, heads, head_dim)
        self.initial = self.pool.clone()
        self.leases = LeaseTable(PageFence(torch.empty(BLOCKS, dtype=torch.int64)), ttl_s=60)
        self.receiver = NcclReceiver(self.pool, self.leases, timeout_s=timeout_s)

    def job(self, rid: str, src_blocks, dst_blocks, src_pool_args, **extra) -> dict:
        lease = self.leases.grant(rid, dst_blocks)
        desc = TransferDescriptor(rid, "nccl", self.receiver.address, tuple(dst_blocks),
                                  KVLayout.of_pool("m", self.pool), lease.epoch, lease.deadline)
        return {"desc": desc.to_dict(), "src_blocks": list(src_blocks), "pool": list(src_pool_args), **extra}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


def _check_pages(decode: Decode, src: torch.Tensor, src_blocks, dst_blocks) -> None:
    assert _same_bytes(decode.pool[:, :, list(dst_blocks)], src[:, :, list(src_blocks)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", *QUANTIZED])
def test_pages_arrive_byte_for_byte(dtype, tmp_path):
    decodes, jobs, checks = [], [], []
    for i, (layers, block_size) in enumerate([(1, 4), (1, 16), (3, 4), (3, 16)]):
        decode = Decode(layers, block_size, dtype, seed=100 + i)
        src_args = (layers, block_size, dtype, 200 + i)
        decodes.append(decode)
        for name, (src_blocks, dst_blocks) in (("frag", FRAGMENTED), ("contig", CONTIGUOUS), ("few", FEW_RUNS)):
            jobs.append(decode.job(f"{name}-{i}", src_blocks, dst_blocks, src_args))
            checks.append((decode, src_args, src_blocks, dst_blocks))
    try:
        code, results = run_child(jobs, tmp_path)
        assert code == 0 and [r["result"] for r in results] == ["ok"] * len(jobs), results
        touched = {id(d): set() for d in decodes}
        for (decode, src_args, src_blocks, dst_blocks), result in zip(checks, results):
            src = make_pool(*src_args)
            _check_pages(decode, src, src_blocks, dst_blocks)
            layers, block_size = src_args[:2]
            assert result["copies"] == layers * len(coalesce(src_blocks, dst_blocks))
            assert result["bytes"] == layers * 2 * len(src_blocks) * src[0, 0, 0].numel() * src.element_size()
            touched[id(decode)].update(dst_blocks)
        for decode in decodes:  # pages nobody reserved are untouched
            rest = [b for b in range(BLOCKS) if b not in touched[id(decode)]]
            assert _same_bytes(decode.pool[:, :, rest], decode.initial[:, :, rest])
            deadline = time.time() + 5
            while decode.receiver.peers and time.time() < deadline:  # the sender said CLOSE
                time.sleep(0.02)
            assert decode.receiver.peers == 0 and decode.receiver.errors == []
    finally:
        for decode in decodes:
            decode.receiver.close()


def test_stale_and_expired_writes_are_refused_and_land_nowhere(tmp_path):
    decode = Decode(2, 4, "float32", seed=1)
    src_args = (2, 4, "float32", 2)
    stale = decode.job("stale", [0, 2, 4, 6], [0, 2, 4, 6], src_args)  # 4 runs: PACKED
    decode.leases.release("stale")  # released (e.g. aborted) before any byte moved
    expired = decode.job("expired", [3, 4], [5, 9], src_args)  # 2 runs: WRITE
    decode.leases.get("expired").deadline = time.time() - 1
    foreign = decode.job("foreign", [5, 6], [16, 17], src_args)
    foreign["desc"]["block_ids"] = [18, 19]  # a live lease, but pages it does not own
    good = decode.job("good", [7, 8], [12, 13], src_args)
    try:
        code, results = run_child([stale, expired, foreign, good], tmp_path)
        assert code == 0
        assert [r["result"] for r in results] == ["StaleEpochError", "LeaseExpiredError", "StaleEpochError",
                                                  "ok"], results
        assert "stale" in results[0]["message"] and "no longer" in results[2]["message"]
        for untouched in (slice(0, 12), slice(16, 20)):
            assert _same_bytes(decode.pool[:, :, untouched], decode.initial[:, :, untouched])
        _check_pages(decode, make_pool(*src_args), [7, 8], [12, 13])
    finally:
        decode.receiver.close()


def test_sender_killed_mid_transfer_frees_the_receiver(tmp_path):
    # Big runs (8 pages of 16 KiB) so the sender dies with a payload on the wire.
    decode = Decode(2, 16, "float32", seed=3, timeout_s=5, heads=4, head_dim=64)
    src_args = (2, 16, "float32", 4, "cpu", 4, 64)
    try:
        doomed = decode.job("doomed", range(8), range(8), src_args, kill_at_data_send=2)
        start = time.time()
        code, results = run_child([doomed], tmp_path)
        assert code == -signal.SIGKILL and results is None
        while (decode.receiver.peers or not decode.receiver.errors) and time.time() - start < 15:
            time.sleep(0.05)
        assert decode.receiver.peers == 0, "the pair of a dead sender must end"
        assert decode.receiver.errors, "the pair ends with the reason recorded"
        t0 = time.time()
        assert decode.leases.release("doomed") is not None
        assert time.time() - t0 < 1, "releasing the lease must not wait for the dead writer"
        # The receiver keeps accepting: a new prefill worker re-sends into the same pages.
        code, results = run_child([decode.job("retry", range(8), range(8), src_args)], tmp_path)
        assert code == 0 and results[0]["result"] == "ok", results
        _check_pages(decode, make_pool(*src_args), range(8), range(8))
    finally:
        decode.receiver.close()


def test_in_process_pairs_layout_check_and_bounded_close():
    """No default process group: one process may hold a receiver and several senders at once."""
    decode = Decode(2, 4, "float32", seed=5, timeout_s=5)
    src = make_pool(2, 4, "float32", 6)
    senders = [NcclSender(decode.receiver.address, src, timeout_s=5) for _ in range(2)]
    try:
        for i, sender in enumerate(senders):
            job = decode.job(f"r{i}", [i], [10 + i], ())
            desc = TransferDescriptor.from_dict(job["desc"])
            for layer in range(2):
                sender.write(desc, layer, coalesce([i], [10 + i]))
            sender.flush(desc)
            _check_pages(decode, src, [i], [10 + i])
        senders.append(NcclSender(decode.receiver.address, src.to(torch.bfloat16)))
        with pytest.raises(LayoutMismatchError):
            senders[-1].write(desc, 0, [(0, 10, 1)])
        # Quantized pages into a float32 pool: refused by the layout, not by a size check.
        senders.append(NcclSender(decode.receiver.address, make_pool(2, 4, "int8", 7)))
        with pytest.raises(LayoutMismatchError, match="kv_cache_dtype"):
            senders[-1].write(desc, 0, [(0, 10, 1)])
        t0 = time.time()
        decode.receiver.close()  # idle pairs are woken, not waited out
        assert time.time() - t0 < 2 and decode.receiver.peers == 0
        with pytest.raises(TransferAbortedError):
            senders[0].write(desc, 0, [(0, 10, 1)])
            senders[0].flush(desc)
    finally:
        for sender in senders:
            sender.close()
        decode.receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs its two ranks on two GPUs")
def test_cuda_pools_over_nccl(tmp_path):
    decode = Decode(2, 16, "bfloat16", seed=7, device="cuda:1")
    src_args = (2, 16, "bfloat16", 8, "cuda:0")
    try:
        jobs = [decode.job("frag", *FRAGMENTED, src_args), decode.job("contig", *CONTIGUOUS, src_args)]
        code, results = run_child(jobs, tmp_path, timeout=120)
        assert code == 0 and [r["result"] for r in results] == ["ok", "ok"], results
        src = make_pool(*src_args)
        for src_blocks, dst_blocks in (FRAGMENTED, CONTIGUOUS):
            _check_pages(decode, src, src_blocks, dst_blocks)
    finally:
        decode.receiver.close()


@pytest.mark.gpu
def test_nccl_refuses_a_peer_on_the_same_gpu():
    """Prefill and decode on one GPU: NCCL cannot pair them, so the sender says the transport is
    unavailable (the prefill side then takes the next offer) instead of failing mid-transfer."""
    from splitserve.kvtransfer.base import TransportUnavailableError
    decode = Decode(1, 16, "bfloat16", seed=1, device="cuda:0")
    try:
        with pytest.raises(TransportUnavailableError, match="one device"):
            NcclSender(decode.receiver.address, make_pool(1, 16, "bfloat16", 2, "cuda:0"))
        assert decode.receiver.peers == 0
    finally:
        decode.receiver.close()


def test_the_receivers_store_listens_on_its_host_only(tiny_model_dirs):
    """torch's TCPStore listens on every interface whatever host it is given, and has no
    authentication (issue 36, point 7): the receiver's listens where it was told."""
    import psutil
    import torch

    from splitserve.kvtransfer.lease import LeaseTable, PageFence
    from splitserve.kvtransfer.transports.nccl import NcclReceiver
    pool = torch.zeros(2, 2, 4, 8, 2, 16)
    receiver = NcclReceiver(pool, LeaseTable(PageFence(torch.empty(4, dtype=torch.int64)), 30.0), host="127.0.0.1")
    try:
        port = int(receiver.address.rsplit(":", 1)[1])
        listening = [c.laddr for c in psutil.Process().net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert [addr.ip for addr in listening] == ["127.0.0.1"]
    finally:
        receiver.close()


def test_with_a_key_only_senders_holding_it_find_the_receivers_store(tmp_path):
    """The store has no authentication (issue 36, point 7): with the workers' key, every store key
    a pair uses is under a prefix derived from it. A sender with the key pairs and writes pages; one
    without it, or with another key, finds no receiver (its pairing times out) and the receiver
    serves no pair for it; a raw client of the store finds none of the receiver's keys."""
    import torch.distributed as dist

    from splitserve.kvtransfer.base import TransportUnavailableError
    key = b"k" * 32
    decode = Decode(2, 4, "float32", seed=5, timeout_s=5)
    decode.receiver.close()
    decode.receiver = NcclReceiver(decode.pool, decode.leases, timeout_s=5, key=key)
    src = make_pool(2, 4, "float32", 6)
    sender = NcclSender(decode.receiver.address, src, timeout_s=5, key=key)
    try:
        job = decode.job("r0", [1], [10], ())
        desc = TransferDescriptor.from_dict(job["desc"])
        for layer in range(2):
            sender.write(desc, layer, coalesce([1], [10]))
        sender.flush(desc)
        _check_pages(decode, src, [1], [10])
        host, port = decode.receiver.address.rsplit(":", 1)
        raw = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=2))
        assert not raw.check(["device"]) and not raw.check(["pair/1"]) and not raw.check(["pairs"])
        for other in (None, b"x" * 32):
            with pytest.raises(TransportUnavailableError):
                NcclSender(decode.receiver.address, src, timeout_s=1, key=other)
        assert decode.receiver.peers == 1  # the keyed sender's pair only
    finally:
        sender.close()
        decode.receiver.close()
