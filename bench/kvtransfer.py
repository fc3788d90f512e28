"""KV transfer throughput: each transport moving a realistic paged KV vs a plain memcpy.

SmolLM2-135M shapes (30 layers, 3 KV heads, head size 64, bf16), block size 16, prompts of
512-4096 tokens, destination pages contiguous or fragmented (every other page). Each case
moves every layer's K and V pages run by run (as the prefill connector does), flushes, and is
timed against `torch` copying the same number of bytes in one call, interleaved in one run
(memcpy, transport, memcpy, transport, ...) after a warm-up; medians are reported.

    python -m bench.kvtransfer --out bench/results/kvtransfer.json
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import median, write_json
from kvtransfer.base import KVLayout, TransferDescriptor, coalesce
from kvtransfer.lease import LeaseTable, PageFence

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
DTYPE = torch.bfloat16


def make_receiver(name: str, num_blocks: int):
    shape = (LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    if name == "shm":
        from kvtransfer.transports.shm import ShmReceiver, create_shared_pool
        pool, owners, directory = create_shared_pool(shape, DTYPE)
        leases = LeaseTable(PageFence(owners), ttl_s=600)
        return ShmReceiver(pool, leases, directory)
    pool = torch.zeros(shape, dtype=DTYPE)
    leases = LeaseTable(PageFence(torch.empty(num_blocks, dtype=torch.int64)), ttl_s=600)
    if name == "tcp":
        from kvtransfer.transports.tcp import TcpReceiver
        return TcpReceiver(pool, leases)
    raise ValueError(name)


def make_sender(name: str, address: str, src: torch.Tensor):
    if name == "shm":
        from kvtransfer.transports.shm import ShmSender
        return ShmSender(address, src)
    from kvtransfer.transports.tcp import TcpSender
    return TcpSender(address, src)


def one_transfer(receiver, sender, tokens: int, layout: str, request_no: int) -> tuple[float, int, int]:
    n = -(-tokens // BLOCK)
    src_blocks = list(range(n))
    dst_blocks = list(range(0, 2 * n, 2)) if layout == "fragmented" else list(range(n))
    rid = f"bench-{request_no}"
    lease = receiver.leases.grant(rid, dst_blocks)
    desc = TransferDescriptor(rid, receiver.name, receiver.address, tuple(dst_blocks),
                              KVLayout.of_pool("smollm2", receiver.pool), lease.epoch, lease.deadline)
    runs = coalesce(src_blocks, dst_blocks)
    copies0, bytes0 = sender.num_copies, sender.bytes_sent
    start = time.perf_counter()
    for layer in range(LAYERS):
        sender.write(desc, layer, runs)
    sender.flush(desc)
    seconds = time.perf_counter() - start
    receiver.leases.release(rid)
    return seconds, sender.num_copies - copies0, sender.bytes_sent - bytes0


def memcpy(nbytes: int, a: torch.Tensor, b: torch.Tensor) -> float:
    n = nbytes // a.element_size()
    start = time.perf_counter()
    b[:n].copy_(a[:n])
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--tokens", default="512,1024,4096")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    token_counts = [int(t) for t in args.tokens.split(",")]
    num_blocks = 2 * -(-max(token_counts) // BLOCK) + 2
    src = torch.randn(LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(DTYPE)
    total = src.numel()
    flat_a, flat_b = torch.randn(total).to(DTYPE), torch.zeros(total, dtype=DTYPE)
    rows = []
    request_no = 0
    for name in args.transports.split(","):
        receiver = make_receiver(name, num_blocks)
        sender = make_sender(name, receiver.address, src)
        try:
            for tokens in token_counts:
                for layout in ("contiguous", "fragmented"):
                    one_transfer(receiver, sender, tokens, layout, request_no)  # warm-up
                    request_no += 1
                    times, copy_times = [], []
                    for _ in range(args.repeats):
                        seconds, copies, nbytes = one_transfer(receiver, sender, tokens, layout, request_no)
                        request_no += 1
                        times.append(seconds)
                        copy_times.append(memcpy(nbytes, flat_a, flat_b))
                    t, m = median(times), median(copy_times)
                    row = {"transport": name, "layout": layout, "tokens": tokens, "bytes": nbytes,
                           "gbps": nbytes / t / 1e9, "memcpy_gbps": nbytes / m / 1e9,
                           "fraction_of_memcpy": m / t, "copies": copies, "latency_ms": 1000 * t}
                    rows.append(row)
                    print(f"{name:5s} {layout:10s} {tokens:5d} tok  {row['gbps']:6.2f} GB/s  "
                          f"memcpy {row['memcpy_gbps']:6.2f} GB/s  {row['fraction_of_memcpy']:5.0%}  "
                          f"{copies:5d} copies  {row['latency_ms']:7.2f} ms", flush=True)
        finally:
            sender.close()
            receiver.close()
    write_json(args.out, {"benchmark": "kvtransfer", "shapes": {"layers": LAYERS, "kv_heads": KV_HEADS,
                                                               "head_dim": HEAD_DIM, "block_size": BLOCK,
                                                               "dtype": "bfloat16"},
                          "method": "interleaved memcpy/transport after a warm-up; medians of --repeats",
                          "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
