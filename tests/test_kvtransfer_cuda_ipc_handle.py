"""cuda_ipc without a GPU: the handle's JSON codec, and the fallback when a handle cannot be opened.

What torch puts in a CUDA tensor's handle is built here exactly as ``reduce_tensor`` builds it
(its CUDA branch), with the same class expressions: ``type(tensor)`` and
``type(tensor._typed_storage())``. Opening a handle needs a GPU (tests/test_kvtransfer_cuda.py).
"""
import dataclasses
import json
import logging

import pytest
import torch

from splitserve.engine import SamplingParams
from splitserve.worker.wiring import build_decode, build_prefill
from splitserve.kvtransfer.transports.cuda_ipc import CudaIpcSender, decode_handle, encode_handle
from splitserve.kvtransfer.transports.shm import ShmReceiver, create_pool_directory
from tests.test_engine_correctness import mixed_prompts
from tests.test_kvtransfer_handoff import config

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def handle_args(tensor: torch.Tensor) -> tuple:
    """The arguments ``reduce_tensor`` hands ``rebuild_cuda_tensor`` for a CUDA ``tensor`` (same order,
    same class expressions); the IPC, ref-counter and event handles are opaque bytes."""
    storage = tensor._typed_storage()
    return (type(tensor), tensor.size(), tensor.stride(), tensor.storage_offset(), type(storage), tensor.dtype,
            0, b"\x01cuda-ipc-memory-handle" + bytes(40), tensor.untyped_storage().nbytes(), 0, tensor.requires_grad,
            b"/torch_123_refcounter", 0, b"\x02cuda-ipc-event-handle" + bytes(40), True)


def test_handle_of_what_torch_sends_round_trips_through_json():
    args = handle_args(torch.zeros(4, 2, 8, 16, 3, 64, dtype=torch.bfloat16))
    assert args[4] is torch.storage.TypedStorage  # the class the old allow-list refused
    assert decode_handle(json.loads(json.dumps(encode_handle(args)))) == args


@pytest.mark.parametrize("entry", [{"class": "builtins.eval"}, {"class": "os.system"}, {"pickle": "gASV"},
                                   [1, 2], {"dtype": "Tensor"}])
def test_a_handle_naming_anything_else_is_refused(entry):
    encoded = encode_handle(handle_args(torch.zeros(2, 2)))
    encoded[4] = entry
    with pytest.raises(ValueError):
        decode_handle(encoded)
    with pytest.raises(ValueError, match="cannot export"):
        encode_handle((eval,))


@pytest.mark.parametrize("handle", ["unopenable", "unlisted class"])
def test_a_cuda_ipc_offer_that_cannot_open_falls_back_to_the_next_transport(handle, tiny_model_dirs, hf_reference,
                                                                             caplog):
    """The decode worker offers cuda_ipc first; a prefill worker that cannot open the handle (here:
    no CUDA; in production: another host or namespace) takes the next offer instead of failing."""
    model = tiny_model_dirs["llama"]
    decode = build_decode(config(model, block_size=8), "tcp")
    prefill = build_prefill(config(model, block_size=8))
    pool = decode.engine.runner.kv_cache
    encoded = encode_handle(handle_args(pool))
    if handle == "unlisted class":
        encoded[4] = {"class": "builtins.eval"}
    _, directory = create_pool_directory(pool.shape, pool.dtype, {"ipc": encoded})
    ipc_dir = ShmReceiver(pool, decode.leases, directory)  # owns the directory; removes it at close
    try:
        with pytest.raises(Exception) as refused:
            CudaIpcSender(str(directory), prefill.engine.runner.kv_cache)
        assert type(refused.value).__name__ == "TransportUnavailableError"
        prompt = mixed_prompts(1, seed=5, lo=20, hi=20)[0]
        desc = decode.reserve("c", len(prompt))
        offered = dataclasses.replace(desc, transport="cuda_ipc", address=str(directory),
                                      alternatives=((desc.transport, desc.address),))
        with caplog.at_level(logging.WARNING, logger="splitserve.kvtransfer.prefill_side"):
            prefill.start("c", prompt, GREEDY, offered)
            [result] = prefill.step()
        assert result.error is None and result.transport == "tcp"
        assert "falls back to tcp" in caplog.text and "cuda_ipc" in caplog.text
        out = decode.complete("c", result.epoch, prompt, GREEDY, result.first_token)
        while not out.finished:
            [out] = decode.engine.step()
        assert out.token_ids == hf_reference(model).greedy(prompt, 6)
        decode.engine.assert_idle()
        prefill.engine.assert_idle()
    finally:
        ipc_dir.close()
        prefill.close()
        decode.close()
