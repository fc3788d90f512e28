"""CUDA transports, two processes on one GPU (run on a GPU machine; skipped without CUDA)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvtransfer.base import KVLayout, TransferDescriptor

pytestmark = pytest.mark.gpu

SHAPE = (4, 2, 64, 16, 3, 64)

SENDER = textwrap.dedent("""
    import json, sys, torch
    from kvtransfer.base import TransferDescriptor, coalesce
    from kvtransfer.transports.cuda_ipc import CudaIpcSender
    desc = TransferDescriptor.from_dict(json.loads(sys.argv[1]))
    src_blocks = json.loads(sys.argv[2])
    torch.manual_seed(0)
    src = torch.randn(*json.loads(sys.argv[3]), device="cuda").to(torch.bfloat16)
    sender = CudaIpcSender(desc.address, src)
    runs = coalesce(src_blocks, list(desc.block_ids))
    for layer in range(src.shape[0]):
        sender.write(desc, layer, runs)
    sender.flush(desc)
""")


@pytest.mark.parametrize("fragmented", [False, True])
def test_cuda_ipc_pages_land_byte_for_byte(fragmented):
    from kvtransfer.transports.cuda_ipc import CudaIpcReceiver
    pool = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda")
    receiver = CudaIpcReceiver.create(pool, lease_ttl_s=60, clock=__import__("time").time)
    try:
        dst = list(range(0, 40, 2)) if fragmented else list(range(10, 30))
        src_blocks = list(range(5, 25))
        lease = receiver.leases.grant("g", dst)
        desc = TransferDescriptor("g", "cuda_ipc", receiver.address, tuple(dst), KVLayout.of_pool("m", pool),
                                  lease.epoch, lease.deadline)
        subprocess.run([sys.executable, "-c", SENDER, json.dumps(desc.to_dict()), json.dumps(src_blocks),
                        json.dumps(list(SHAPE))], check=True, timeout=120, env={**os.environ})
        torch.manual_seed(0)
        expected = torch.randn(*SHAPE, device="cuda").to(torch.bfloat16)
        torch.cuda.synchronize()
        assert torch.equal(pool[:, :, dst], expected[:, :, src_blocks])
    finally:
        receiver.close()


def test_engine_handoff_on_cuda_matches_single_engine(tiny_model_dirs):
    """Prefill and decode engines on one GPU, KV through CUDA IPC, greedy equals the colocated engine."""
    from engine import EngineConfig, LLM, SamplingParams
    from kvtransfer import build_decode, build_prefill
    from tests.test_kvtransfer_handoff import handoff
    model = str(tiny_model_dirs["llama"])
    cfg = dict(model=model, dtype="float32", num_gpu_blocks=128, block_size=16, device="cuda")
    decode = build_decode(EngineConfig(**cfg), "cuda_ipc")
    prefill = build_prefill(EngineConfig(**cfg), verify_checksum=True)
    prompts = [[1, 2, 3, 4, 5] * 7, [9, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        outputs, _ = handoff(prefill, decode, prompts, params)
        colocated = LLM(**cfg).generate(prompts, params)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in colocated]
    finally:
        prefill.close()
        decode.close()
