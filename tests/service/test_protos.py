"""The committed generated stubs match the protos, and the API looks as documented."""
from __future__ import annotations

import json

import pytest
from google.protobuf import descriptor_pb2, json_format

from protos import codegen
from splitserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

REGEN_HINT = "generated stubs are stale: run python -m protos.codegen (and commit the result)"


def test_generated_stubs_match_protos(tmp_path):
    fresh = codegen.generate(tmp_path)
    committed = codegen.generated_files(codegen.REPO_ROOT)
    assert fresh == committed, f"{REGEN_HINT}; files differ: {fresh} vs {committed}"
    assert len(fresh) == 3 * len(codegen.PROTO_FILES)
    for rel in fresh:
        new = (tmp_path / rel).read_bytes()
        old = (codegen.REPO_ROOT / rel).read_bytes()
        assert new == old, f"{rel} differs; {REGEN_HINT}"


def test_generate_request_json_names():
    req = json_format.Parse('{"text":"hi","sampling":{"max_tokens":5,"temperature":0}}',
                            generation_pb2.GenerateRequest())
    assert req.text == "hi"
    assert req.sampling.max_tokens == 5
    assert req.sampling.HasField("temperature") and req.sampling.temperature == 0.0

    req = json_format.Parse('{"token_ids":[1,2], "priority": -3, "stream_interval": 4, "request_id": "r1"}',
                            generation_pb2.GenerateRequest())
    assert list(req.token_ids) == [1, 2]
    assert (req.priority, req.stream_interval, req.request_id) == (-3, 4, "r1")

    req = json_format.Parse('{"messages":[{"role":"user","content":"hi"}]}', generation_pb2.GenerateRequest())
    assert [(m.role, m.content) for m in req.messages] == [("user", "hi")]

    body = ('{"text":"x","sampling":{"top_p":0.9,"top_k":-1,"min_p":0.05,"seed":7,"min_tokens":1,'
            '"repetition_penalty":1.1,"frequency_penalty":0.5,"presence_penalty":-0.5,"stop":["\\n"],'
            '"stop_token_ids":[2],"ignore_eos":true,"logprobs":3}}')
    s = json_format.Parse(body, generation_pb2.GenerateRequest()).sampling
    assert (s.top_p, s.top_k, s.seed, s.logprobs, list(s.stop), list(s.stop_token_ids), s.ignore_eos) == (
        0.9, -1, 7, 3, ["\n"], [2], True)


def test_unknown_json_field_is_rejected():
    with pytest.raises(json_format.ParseError):
        json_format.Parse('{"prompt":"hi"}', generation_pb2.GenerateRequest())


def test_final_response_json():
    resp = generation_pb2.GenerateResponse(final=generation_pb2.Final(
        finish_reason="length", usage=generation_pb2.Usage(prompt_tokens=3, completion_tokens=5),
        timeline=generation_pb2.Timeline(first_token_ms=12.5, prefill_worker="p0")))
    as_json = json_format.MessageToJson(resp, preserving_proto_field_name=True)
    assert '"finish_reason": "length"' in as_json
    assert json.loads(as_json)["final"]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5}
    # Default proto3 JSON (what grpcurl prints) uses lowerCamelCase; parsing accepts both.
    assert '"finishReason": "length"' in json_format.MessageToJson(resp)
    assert json_format.Parse(as_json, generation_pb2.GenerateResponse()) == resp
    assert resp.WhichOneof("response") == "final"
    chunk = generation_pb2.GenerateResponse(chunk=generation_pb2.Chunk(token_ids=[5], text="a"))
    assert chunk.WhichOneof("response") == "chunk"


def test_optional_fields_distinguish_unset_from_zero():
    s = generation_pb2.SamplingParams()
    for name in ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                 "repetition_penalty", "frequency_penalty", "presence_penalty", "logprobs"):
        assert not s.HasField(name), name
        setattr(s, name, 0)
        assert s.HasField(name), name
    wire = generation_pb2.SamplingParams.FromString(s.SerializeToString())
    assert wire.HasField("temperature") and wire.temperature == 0.0
    assert worker_pb2.PrefillResponse().HasField("checksum") is False
    assert worker_pb2.PrefillResponse(checksum=0).HasField("checksum")
    assert worker_pb2.DecodeRequest(checksum=0).HasField("checksum")
    assert not worker_pb2.DecodeChunk().HasField("finish_reason")


def _methods(file_descriptor, service: str) -> dict[str, tuple[str, str, bool, bool]]:
    proto = descriptor_pb2.ServiceDescriptorProto()
    file_descriptor.services_by_name[service].CopyToProto(proto)
    return {m.name: (m.input_type.rsplit(".", 1)[-1], m.output_type.rsplit(".", 1)[-1],
                     m.client_streaming, m.server_streaming) for m in proto.method}


def test_generation_service_methods():
    assert generation_pb2.DESCRIPTOR.package == "splitserve.v1"
    assert _methods(generation_pb2.DESCRIPTOR, "Generation") == {
        "Generate": ("GenerateRequest", "GenerateResponse", False, True),
        "Abort": ("AbortRequest", "AbortResponse", False, False),
        "GetRequest": ("GetRequestRequest", "RequestInfo", False, False),
        "Tokenize": ("TokenizeRequest", "TokenizeResponse", False, False),
        "Detokenize": ("DetokenizeRequest", "DetokenizeResponse", False, False),
        "GetModelInfo": ("GetModelInfoRequest", "ModelInfo", False, False),
        "GetServerInfo": ("GetServerInfoRequest", "ServerInfo", False, False),
        "LoadLoRAAdapter": ("LoadLoRAAdapterRequest", "LoRAAdapterResponse", False, False),
        "UnloadLoRAAdapter": ("UnloadLoRAAdapterRequest", "LoRAAdapterResponse", False, False),
    }
    assert hasattr(generation_pb2_grpc, "GenerationStub")
    assert hasattr(generation_pb2_grpc, "add_GenerationServicer_to_server")


def test_worker_service_methods():
    assert worker_pb2.DESCRIPTOR.package == "splitserve.v1"
    assert _methods(worker_pb2.DESCRIPTOR, "PrefillWorker") == {
        "Prefill": ("PrefillRequest", "PrefillResponse", False, False),
        "Abort": ("WorkerAbortRequest", "WorkerAbortResponse", False, False),
        "GetWorkerInfo": ("WorkerInfoRequest", "WorkerInfo", False, False),
        "LoadLoRA": ("LoadLoRAAdapterRequest", "LoRAAdapterResponse", False, False),
        "UnloadLoRA": ("UnloadLoRAAdapterRequest", "LoRAAdapterResponse", False, False),
    }
    assert _methods(worker_pb2.DESCRIPTOR, "DecodeWorker") == {
        "Reserve": ("ReserveRequest", "ReserveResponse", False, False),
        "Decode": ("DecodeRequest", "DecodeChunk", False, True),
        "Abort": ("WorkerAbortRequest", "WorkerAbortResponse", False, False),
        "GetWorkerInfo": ("WorkerInfoRequest", "WorkerInfo", False, False),
        "RenewLease": ("RenewLeaseRequest", "RenewLeaseResponse", False, False),
        "LoadLoRA": ("LoadLoRAAdapterRequest", "LoRAAdapterResponse", False, False),
        "UnloadLoRA": ("UnloadLoRAAdapterRequest", "LoRAAdapterResponse", False, False),
    }
    # WorkerInfo is shared with the public API, not redefined; workers get sampling resolved
    # by the gateway (every field set, nothing optional but the seed, logprobs and the
    # structured-output constraint, with the reasoning opener that may gate it).
    worker_info = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].methods_by_name["GetWorkerInfo"]
    assert worker_info.output_type is generation_pb2.WorkerInfo.DESCRIPTOR
    for request in (worker_pb2.PrefillRequest, worker_pb2.DecodeRequest):
        assert request.DESCRIPTOR.fields_by_name["sampling"].message_type is worker_pb2.ResolvedSampling.DESCRIPTOR
    optional = {f.name for f in worker_pb2.ResolvedSampling.DESCRIPTOR.fields if f.has_presence}
    assert optional == {"seed", "logprobs", "structured_output", "structured_output_after_opener"}
    for name in ("PrefillWorkerStub", "DecodeWorkerStub", "add_PrefillWorkerServicer_to_server",
                 "add_DecodeWorkerServicer_to_server"):
        assert hasattr(worker_pb2_grpc, name)
