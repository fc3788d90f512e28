"""KV transfer throughput: each transport moving a realistic paged KV vs a plain copy of the same bytes.

SmolLM2-135M shapes (30 layers, 3 KV heads, head size 64, bf16), block size 16, prompts of
512-4096 tokens. Page tables: ``contiguous`` (one run per layer), ``fragmented`` (destination
pages every other page: one-page runs) and ``scattered`` (source and destination page ids both
drawn at random, as in pools after a while of serving). The sender runs in its own process, as a
prefill worker does; it moves every layer's K and V pages run by run (as the prefill connector
does) and flushes. Each transfer is timed against `torch` copying the same number of bytes in one
call on the same device (a memcpy on CPU, a device-to-device copy on a GPU), interleaved in one
run (copy, transport, copy, transport, ...) after a warm-up; medians are reported. Latency = write
of all layers + flush, i.e. one handoff's data time.

    python -m bench.kvtransfer --out bench/results/kvtransfer.json
    python -m bench.kvtransfer --device cuda --transports cuda_ipc --out gpu.json   # on a GPU machine
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import median, write_json
from splitserve.kvtransfer.base import KVLayout, TransferDescriptor, coalesce
from splitserve.kvtransfer.lease import LeaseTable, PageFence

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
DTYPE = torch.bfloat16


def make_receiver(name: str, num_blocks: int, device: str = "cpu"):
    shape = (LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    if name == "cuda_ipc":
        from splitserve.kvtransfer.transports.cuda_ipc import CudaIpcReceiver
        return CudaIpcReceiver.create(torch.zeros(shape, dtype=DTYPE, device=device), lease_ttl_s=600, clock=time.time)
    if name == "shm":
        from splitserve.kvtransfer.transports.shm import ShmReceiver, create_shared_pool
        pool, owners, directory = create_shared_pool(shape, DTYPE)
        pool.zero_()  # a serving pool's pages are in memory; a fresh /dev/shm file's fault in at first write
        leases = LeaseTable(PageFence(owners), ttl_s=600)
        return ShmReceiver(pool, leases, directory)
    pool = torch.zeros(shape, dtype=DTYPE, device=device)
    leases = LeaseTable(PageFence(torch.empty(num_blocks, dtype=torch.int64)), ttl_s=600)
    if name == "tcp":
        from splitserve.kvtransfer.transports.tcp import TcpReceiver
        return TcpReceiver(pool, leases)
    if name == "nccl":
        from splitserve.kvtransfer.transports.nccl import NcclReceiver
        return NcclReceiver(pool, leases)
    raise ValueError(name)


def sender_process(name: str, address: str, num_blocks: int, device: str = "cpu") -> None:
    """Child: reads one descriptor per line, transfers, answers with its timing (JSON lines)."""
    from splitserve.kvtransfer import sender_factories
    src = torch.randn(LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(DTYPE).to(device)
    sender = sender_factories(src, [name])[name](address)
    mapped = getattr(sender, "dst_pool", None)
    if mapped is not None and mapped.device.type == "cpu":
        # A serving prefill worker's mapping of the decode pool has every page mapped after its first
        # transfers; fault them in now (one read per 4 KiB) so scattered tables measure copies, not faults.
        mapped.view(-1).view(torch.uint8)[::4096].sum()
    for line in sys.stdin:
        job = json.loads(line)
        desc = TransferDescriptor.from_dict(job["desc"])
        runs = coalesce(job["src_blocks"], list(desc.block_ids))
        copies0, bytes0 = sender.num_copies, sender.bytes_sent
        start = time.perf_counter()
        for layer in range(LAYERS):
            sender.write(desc, layer, runs)
        sender.flush(desc)
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "copies": sender.num_copies - copies0,
                          "bytes": sender.bytes_sent - bytes0}), flush=True)
    sender.close()


class RemoteSender:
    def __init__(self, name: str, address: str, num_blocks: int, device: str = "cpu"):
        code = (f"from bench.kvtransfer import sender_process; "
                f"sender_process({name!r}, {address!r}, {num_blocks}, {device!r})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=Path(__file__).resolve().parent.parent)

    def transfer(self, desc: TransferDescriptor, src_blocks: list[int]) -> dict:
        self.proc.stdin.write(json.dumps({"desc": desc.to_dict(), "src_blocks": src_blocks}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"sender process ended (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def page_tables(tokens: int, layout: str, num_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    """(source, destination) page ids of one request's pages."""
    n = -(-tokens // BLOCK)
    if layout == "scattered":
        rng = random.Random(seed)
        return rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
    return list(range(n)), list(range(0, 2 * n, 2)) if layout == "fragmented" else list(range(n))


def one_transfer(receiver, sender: RemoteSender, tokens: int, layout: str, request_no: int) -> dict:
    src_blocks, dst_blocks = page_tables(tokens, layout, receiver.pool.shape[2], request_no)
    rid = f"bench-{request_no}"
    lease = receiver.leases.grant(rid, dst_blocks)
    desc = TransferDescriptor(rid, receiver.name, receiver.address, tuple(dst_blocks),
                              KVLayout.of_pool("smollm2", receiver.pool), lease.epoch, lease.deadline)
    try:
        return sender.transfer(desc, src_blocks)
    finally:
        receiver.leases.release(rid)


def memcpy(nbytes: int, a: torch.Tensor, b: torch.Tensor) -> float:
    """Seconds for torch to copy ``nbytes`` from a to b in one call (device-to-device on a GPU)."""
    n = nbytes // a.element_size()
    if a.is_cuda:
        torch.cuda.synchronize(a.device)
    start = time.perf_counter()
    b[:n].copy_(a[:n])
    if a.is_cuda:
        torch.cuda.synchronize(a.device)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--transports", default="shm,tcp,nccl")
    parser.add_argument("--tokens", default="512,1024,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layouts", default="contiguous,fragmented,scattered")
    parser.add_argument("--device", default="cpu", help="where both pools live (cuda: cuda_ipc vs a device copy)")
    args = parser.parse_args(argv)
    rows = run(args.transports.split(","), [int(t) for t in args.tokens.split(",")], args.layouts.split(","),
               args.repeats, args.device)
    write_json(args.out, {"benchmark": "kvtransfer", "shapes": {"layers": LAYERS, "kv_heads": KV_HEADS,
                                                               "head_dim": HEAD_DIM, "block_size": BLOCK,
                                                               "dtype": "bfloat16"},
                          "device": args.device,
                          "baseline": "device-to-device torch copy" if args.device != "cpu" else "torch memcpy",
                          "method": "interleaved copy/transport after a warm-up; medians of --repeats",
                          "results": rows})
    return 0


def run(transports: list[str], token_counts: list[int], layouts: list[str], repeats: int,
        device: str = "cpu") -> list[dict]:
    """One row per (transport, layout, tokens): the transport's and the plain copy's medians."""
    num_blocks = 2 * -(-max(token_counts) // BLOCK) + 2
    total = LAYERS * 2 * num_blocks * BLOCK * KV_HEADS * HEAD_DIM
    flat_a, flat_b = torch.randn(total).to(DTYPE).to(device), torch.zeros(total, dtype=DTYPE, device=device)
    rows = []
    request_no = 0
    for name in transports:
        receiver = make_receiver(name, num_blocks, device)
        sender = RemoteSender(name, receiver.address, num_blocks, device)
        try:
            for tokens in token_counts:
                for layout in layouts:
                    one_transfer(receiver, sender, tokens, layout, request_no)  # warm-up
                    request_no += 1
                    times, copy_times = [], []
                    for _ in range(repeats):
                        result = one_transfer(receiver, sender, tokens, layout, request_no)
                        request_no += 1
                        copies, nbytes = result["copies"], result["bytes"]
                        times.append(result["seconds"])
                        copy_times.append(memcpy(nbytes, flat_a, flat_b))
                    t, m = median(times), median(copy_times)
                    row = {"transport": name, "layout": layout, "tokens": tokens, "bytes": nbytes,
                           "gbps": nbytes / t / 1e9, "memcpy_gbps": nbytes / m / 1e9,
                           "fraction_of_memcpy": m / t, "copies": copies, "latency_ms": 1000 * t}
                    rows.append(row)
                    print(f"{name:8s} {layout:10s} {tokens:5d} tok  {row['gbps']:7.2f} GB/s  "
                          f"copy {row['memcpy_gbps']:7.2f} GB/s  {row['fraction_of_memcpy']:5.0%}  "
                          f"{copies:5d} copies  {row['latency_ms']:7.2f} ms", flush=True)
        finally:
            sender.close()
            receiver.close()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
