"""Workers configured the normal way (one ``--internal-token`` for every process, KV over tcp) move
KV over an authenticated tcp socket, and that socket refuses a writer without the secret.

Real processes on loopback: Redis, a decode and a prefill worker with ``--kv-transport tcp``, a
gateway; the internal token reaches them through ``SPLITSERVE_INTERNAL_TOKEN``, as ``up`` and
compose hand it on.
"""
import secrets
import socket

import pytest

from splitserve.kvtransfer.transports import tcp
from splitserve.worker.descriptors import descriptor_from_proto
from splitserve.common.security import Security
from tests.harness.stack import start_stack
from tests.harness.tools import scrape
from splitserve.v1 import worker_pb2, worker_pb2_grpc

PROMPT = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
RPC_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    token = secrets.token_urlsafe(16)
    env = {"SPLITSERVE_INTERNAL_TOKEN": token}
    running = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1,
                          worker_args=["--kv-transport", "tcp"],
                          role_env={"decode": env, "prefill": env, "gateway": env})
    running.internal_token = token
    try:
        yield running
    finally:
        running.close()


def tcp_bytes_sent(stack) -> float:
    return scrape(stack.metrics_ports["prefill"])["splitserve:kv_transfer_bytes_total{transport=tcp}"]


def test_requests_move_their_kv_over_the_authenticated_tcp_socket(stack, llama_reference):
    before = tcp_bytes_sent(stack)
    for max_tokens in (4, 9):
        _, final = stack.client.complete(PROMPT, max_tokens=max_tokens, ignore_eos=True, temperature=0.0, timeout=120)
        assert final.finish_reason == "length"
    assert tcp_bytes_sent(stack) > before
    text_ids = []
    for event in stack.client.generate(PROMPT, max_tokens=6, ignore_eos=True, temperature=0.0, timeout=120):
        text_ids += event.token_ids
    assert text_ids == llama_reference.greedy(PROMPT, 6)


def test_the_decode_workers_kv_socket_refuses_a_writer_without_the_secret(stack):
    decode = worker_pb2_grpc.DecodeWorkerStub(Security(token=stack.internal_token).channel(stack.addresses["decode"]))
    reserved = decode.Reserve(worker_pb2.ReserveRequest(request_id="intruder-target", num_prompt_tokens=16),
                              timeout=RPC_TIMEOUT_S)
    desc = descriptor_from_proto(reserved.descriptor)
    try:
        assert desc.transport == "tcp"
        host, port = desc.address.rsplit(":", 1)
        payload = b"\x5a" * (2 * desc.layout.page_bytes)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(tcp.frame(tcp.WRITE, b"intruder-target", desc.epoch, 0, desc.block_ids[0], 1, len(payload))
                      + payload + tcp.frame(tcp.FLUSH, b"intruder-target", desc.epoch))
            s.shutdown(socket.SHUT_WR)
            reply = b""
            try:
                while chunk := s.recv(65536):
                    reply += chunk
            except OSError:
                pass
        fields = tcp.HEADER.unpack(reply[:tcp.HEADER.size])
        assert fields[2] == tcp.ERROR
        assert b"authentication required" in reply[tcp.HEADER.size:]
    finally:
        decode.Abort(worker_pb2.WorkerAbortRequest(request_id="intruder-target"), timeout=RPC_TIMEOUT_S)
    # The workers keep serving through the gateway.
    _, final = stack.client.complete(PROMPT, max_tokens=3, ignore_eos=True, temperature=0.0, timeout=120)
    assert final.finish_reason == "length"
