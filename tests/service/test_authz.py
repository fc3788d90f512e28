"""Who may touch what (docs/security.md, Who may do what), against real processes on loopback.

One stack: Redis, a decode and a prefill worker that require the internal token, and a gateway
with two client identities (``--auth-token`` A, B from ``--token-file``), an admin token and the
internal token. Checked: a request belongs to the token that created it (B can neither read nor
abort A's, the admin can do both, by A's scoped id); request ids are scoped by token (A and B run
requests of one id at once, each aborts only its own, neither can take the other's sample ids,
over gRPC and HTTP); worker and metrics addresses only for the admin; no local
path in ModelInfo; a worker port refuses every credential but the internal token (a direct
Reserve takes no page) while the gateway keeps serving; a worker record in Redis that is not
signed with the internal token gets no request; configurations that would leave the workers open
to clients do not start.
"""
import concurrent.futures
import json
import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client import Client
from splitserve.common.authz import scoped_id, token_owner
from splitserve.common.processes import free_port
from splitserve.common.security import Security
from splitserve.state.store import RedisState
from tests.harness.redis_server import RedisServer
from tests.harness.stack import DEFAULT_WORKER_ARGS, start_process
from tests.harness.streams import wait_until
from tests.harness.tools import scrape
from splitserve.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
RPC_TIMEOUT_S = 10
# Each decode step of the stack's decode worker takes at least this long, so a request of
# LONG_TOKENS tokens stays running (~10 s) while other callers try to touch it.
STEP_DELAY_S = "0.05"
LONG_TOKENS = 200


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    model = str(tiny_model_dirs["llama"])
    d = tmp_path_factory.mktemp("authz")
    tokens = {name: secrets.token_urlsafe(16) for name in ("a", "b", "admin", "internal")}
    (d / "tokens.txt").write_text(f"# further client tokens\n\n{tokens['b']}\n")
    redis_server = RedisServer().start()
    worker_env = {"SPLITSERVE_INTERNAL_TOKEN": tokens["internal"]}
    common = ["--model", model, *DEFAULT_WORKER_ARGS, "--redis-url", redis_server.url, "--metrics-port", "0"]
    procs = []
    try:
        decode, decode_addr = start_process(["decode", *common], d / "decode.log",
                                            env={**worker_env, "SPLITSERVE_FAULT_STEP_DELAY_S": STEP_DELAY_S})
        procs.append(decode)
        prefill, prefill_addr = start_process(["prefill", *common], d / "prefill.log", env=worker_env)
        procs.append(prefill)
        http_port = free_port()
        gateway, gateway_addr = start_process(
            ["gateway", "--model", model, "--host", "127.0.0.1", "--port", "0", "--redis-url", redis_server.url,
             "--block-size", "8", "--metrics-port", "0", "--token-file", str(d / "tokens.txt"),
             "--http-port", str(http_port)], d / "gateway.log",
            env={**worker_env, "SPLITSERVE_AUTH_TOKEN": tokens["a"], "SPLITSERVE_ADMIN_TOKEN": tokens["admin"]})
        procs.append(gateway)
        clients = {name: Client(gateway_addr, token=tokens[name]) for name in ("a", "b", "admin")}
        wait_until(lambda: {w.address for w in clients["admin"].server_info().workers} >= {decode_addr, prefill_addr},
                   60, "the gateway to list both workers")
        yield {"model": model, "tokens": tokens, "gateway": gateway_addr, "http": f"http://127.0.0.1:{http_port}",
               "redis": redis_server, "gateway_log": d / "gateway.log", "decode": decode_addr,
               "prefill": prefill_addr, "clients": clients}
        for client in clients.values():
            client.close()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        redis_server.close()


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def get_request(client: Client, request_id: str) -> generation_pb2.RequestInfo:
    return client.stub.GetRequest(generation_pb2.GetRequestRequest(request_id=request_id), timeout=RPC_TIMEOUT_S)


LONG_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


class Stream:
    """A long generation of one client, consumed on a thread; ``error`` is how it ended, if it failed."""

    def __init__(self, client: Client, request_id: str, prompt: list[int] = LONG_PROMPT):
        self.tokens: list[int] = []
        self.request_ids: set[str] = set()  # as the responses name the request
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._run, args=(client, request_id, prompt), daemon=True)
        self.thread.start()

    def _run(self, client, request_id, prompt):
        try:
            for event in client.generate(prompt, request_id=request_id, max_tokens=LONG_TOKENS,
                                         ignore_eos=True, temperature=0.0, timeout=120):
                self.tokens += event.token_ids
                self.request_ids.add(event.request_id)
        except grpc.RpcError as e:
            self.error = e

    def join(self) -> None:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the stream did not end"


def test_a_request_belongs_to_the_token_that_created_it(stack):
    a, b, admin = (stack["clients"][n] for n in ("a", "b", "admin"))
    rid = f"owned-{secrets.token_hex(4)}"
    stream = Stream(a, rid)
    wait_until(lambda: stream.tokens, 60, "A's request to stream")
    # B: the request looks like no request at all, and B's Abort changes nothing.
    err = rpc_error(lambda: get_request(b, rid))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    unknown = rpc_error(lambda: get_request(b, "no-such-id")).details()
    assert err.details() == unknown.replace("no-such-id", rid)  # nothing tells them apart
    assert b.abort(rid) is False
    assert get_request(a, rid).state not in ("aborted", "finished")
    assert stream.thread.is_alive() and stream.error is None
    # The admin reads it and aborts it, by the id scoped to A (as logs and traces name it); the
    # bare id names the admin's own requests, of which there is none.
    scoped = scoped_id(token_owner(stack["tokens"]["a"]), rid)
    assert rpc_error(lambda: get_request(admin, rid)).code() == grpc.StatusCode.NOT_FOUND
    assert admin.abort(rid) is False and stream.thread.is_alive()
    assert get_request(admin, scoped).request_id == scoped
    assert admin.abort(scoped) is True
    stream.join()
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.CANCELLED
    assert len(stream.tokens) < LONG_TOKENS
    wait_until(lambda: get_request(a, rid).state == "aborted", 10, "the abort to be recorded")
    # Ended, it is still A's (read above) and not B's.
    assert rpc_error(lambda: get_request(b, rid)).code() == grpc.StatusCode.NOT_FOUND


def test_the_owner_may_abort_its_own_request_and_the_other_one_its_own(stack):
    a, b = stack["clients"]["a"], stack["clients"]["b"]
    rid_b = f"b-{secrets.token_hex(4)}"
    stream = Stream(b, rid_b)  # B (a --token-file token) owns this one
    wait_until(lambda: stream.tokens, 60, "B's request to stream")
    assert a.abort(rid_b) is False and stream.thread.is_alive()
    assert get_request(b, rid_b).request_id == rid_b
    assert b.abort(rid_b) is True
    stream.join()
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.CANCELLED


def wait_decode_idle(stack) -> None:
    """Until the decode worker runs nothing: an aborted stream's worker-side end comes a moment
    after its client's, and later tests read the worker's free pages."""
    decode = worker_pb2_grpc.DecodeWorkerStub(Security(token=stack["tokens"]["internal"]).channel(stack["decode"]))

    def idle() -> bool:
        info = decode.GetWorkerInfo(worker_pb2.WorkerInfoRequest(), timeout=RPC_TIMEOUT_S)
        return info.num_running == 0 and info.num_waiting == 0
    wait_until(idle, 30, "the decode worker to finish with the aborted requests")


def test_two_identities_may_use_one_request_id_at_once(stack, llama_reference):
    """Request ids are scoped by identity: B's request with the id A's running request has
    is admitted and runs beside it, each with its own tokens and its own id in its responses;
    the same identity reusing its live id is ALREADY_EXISTS; reads and aborts by the id reach the
    caller's own request only."""
    a, b = stack["clients"]["a"], stack["clients"]["b"]
    rid = f"shared-{secrets.token_hex(4)}"
    prompt_b = [7, 6, 5, 4, 3, 2, 1, 9]
    stream_a = Stream(a, rid)
    wait_until(lambda: stream_a.tokens, 60, "A's request to stream")
    stream_b = Stream(b, rid, prompt=prompt_b)
    wait_until(lambda: stream_b.tokens or stream_b.error, 60, "B's request with A's id to stream")
    assert stream_b.error is None
    for client in (a, b):  # each identity's own id is taken while its request runs
        err = rpc_error(lambda: list(client.generate([3, 4], request_id=rid, max_tokens=1, timeout=30)))
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "still running" in err.details()
    assert get_request(a, rid).request_id == rid and get_request(b, rid).request_id == rid
    # B aborts its request of that id: A's runs on.
    assert b.abort(rid) is True
    stream_b.join()
    assert stream_b.error is not None and stream_b.error.code() == grpc.StatusCode.CANCELLED
    wait_until(lambda: get_request(b, rid).state == "aborted", 10, "B's abort to be recorded")
    assert get_request(a, rid).state not in ("aborted", "finished")
    assert stream_a.thread.is_alive() and stream_a.error is None
    assert a.abort(rid) is True
    stream_a.join()
    assert stream_a.request_ids == stream_b.request_ids == {rid}
    # Each got the tokens of its own prompt (greedy: transformers' output, cut where it was aborted).
    assert stream_a.tokens == llama_reference.greedy(LONG_PROMPT, LONG_TOKENS)[:len(stream_a.tokens)]
    assert stream_b.tokens == llama_reference.greedy(prompt_b, LONG_TOKENS)[:len(stream_b.tokens)]
    assert stream_a.tokens and stream_b.tokens
    wait_decode_idle(stack)


def test_no_identity_can_take_the_sample_ids_of_anothers_request(stack, llama_reference):
    """The samples of an n = 2 request are ``<id>/1``...: B running a request named ``<id>/1``
    first does not keep A's n = 2 request ``<id>`` from running both its samples."""
    a, b = stack["clients"]["a"], stack["clients"]["b"]
    rid = f"squat-{secrets.token_hex(4)}"
    squatter = Stream(b, f"{rid}/1")
    wait_until(lambda: squatter.tokens or squatter.error, 60, "B's request to stream")
    prompt = [3, 4, 5, 6]
    samples: dict[int, list[int]] = {}
    finals = {}
    for event in a.generate(prompt, request_id=rid, n=2, max_tokens=4, ignore_eos=True, temperature=0.0,
                            timeout=60):
        assert event.request_id == rid
        samples.setdefault(event.index, []).extend(event.token_ids)
        if event.finished:
            finals[event.index] = event.finish_reason
    assert finals == {0: "length", 1: "length"}
    assert samples == {0: llama_reference.greedy(prompt, 4), 1: llama_reference.greedy(prompt, 4)}
    assert get_request(a, f"{rid}/1").state == "finished"
    assert squatter.thread.is_alive() and squatter.error is None and b.abort(f"{rid}/1") is True
    squatter.join()
    wait_decode_idle(stack)


def test_http_request_ids_are_scoped_by_identity_too(stack):
    """Over the OpenAI API a client chooses ``request_id`` as well: B may use the id A's request
    just ended with (an id is held a while after its end: ``ALREADY_EXISTS``, HTTP 409, for A)."""
    tokens = stack["tokens"]

    def post(token: str, request_id: str) -> httpx.Response:
        return httpx.post(stack["http"] + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {token}"},
                          json={"prompt": [3, 4, 5], "max_tokens": 2, "ignore_eos": True, "temperature": 0,
                                "request_id": request_id})
    rid = f"http-shared-{secrets.token_hex(4)}"
    first = post(tokens["a"], rid)
    assert first.status_code == 200 and first.json()["id"] == f"cmpl-{rid}"
    again = post(tokens["a"], rid)
    assert again.status_code == 409 and "ended moments ago" in again.json()["error"]["message"]
    other = post(tokens["b"], rid)
    assert other.status_code == 200, other.text
    assert other.json()["id"] == f"cmpl-{rid}" and other.json()["choices"] == first.json()["choices"]


def test_server_info_lists_addresses_to_the_admin_only(stack):
    internal = {stack["decode"], stack["prefill"]}
    seen = stack["clients"]["admin"].server_info().workers
    assert internal <= {w.address for w in seen}
    assert all(w.metrics_address for w in seen)  # the gateway's included
    for name in ("a", "b"):
        workers = stack["clients"][name].server_info().workers
        assert {w.role for w in workers} == {"gateway", "decode", "prefill"}
        assert all(not w.address and not w.metrics_address for w in workers), name
        decode = next(w for w in workers if w.role == "decode")
        assert decode.kv_blocks_total == 256  # the load is still there
    # Nothing else in the answer names a worker's port.
    public = stack["clients"]["a"].server_info().SerializeToString()
    for address in internal:
        assert address.encode() not in public


def test_model_info_has_no_local_path(stack):
    for name in ("a", "admin"):
        info = stack["clients"][name].stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
        assert info.model == Path(stack["model"]).name and "/" not in info.model, info.model
        assert stack["model"].encode() not in info.SerializeToString()


def test_http_requests_belong_to_their_token_too(stack):
    """The OpenAI API takes the same client and admin tokens, not the internal one, and its
    requests are owned like gRPC ones (read back over gRPC)."""
    tokens, http = stack["tokens"], stack["http"]

    def post(token: str, request_id: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.post(http + "/v1/completions", timeout=60, headers=headers,
                          json={"prompt": [3, 4, 5], "max_tokens": 2, "ignore_eos": True, "request_id": request_id})
    rid = f"http-b-{secrets.token_hex(4)}"
    assert post(tokens["b"], rid).status_code == 200
    assert get_request(stack["clients"]["b"], rid).state == "finished"
    assert rpc_error(lambda: get_request(stack["clients"]["a"], rid)).code() == grpc.StatusCode.NOT_FOUND
    assert get_request(stack["clients"]["admin"], scoped_id(token_owner(tokens["b"]), rid)).state == "finished"
    assert post(tokens["internal"], "http-internal").status_code == 401
    assert post("", "http-none").status_code == 401
    models = httpx.get(http + "/v1/models", timeout=10, headers={"Authorization": f"Bearer {tokens['admin']}"})
    assert [m["id"] for m in models.json()["data"]] == [Path(stack["model"]).name]


def test_worker_ports_accept_only_the_internal_token(stack):
    tokens = stack["tokens"]
    internal = Security(token=tokens["internal"])
    decode = worker_pb2_grpc.DecodeWorkerStub(internal.channel(stack["decode"]))
    free = decode.GetWorkerInfo(worker_pb2.WorkerInfoRequest(), timeout=RPC_TIMEOUT_S).kv_blocks_free
    for token in ("", tokens["a"], tokens["b"], tokens["admin"]):
        stub = worker_pb2_grpc.DecodeWorkerStub(Security(token=token).channel(stack["decode"]))
        err = rpc_error(lambda: stub.Reserve(worker_pb2.ReserveRequest(request_id="direct", num_prompt_tokens=1000),
                                             timeout=RPC_TIMEOUT_S))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, token
        prefill = worker_pb2_grpc.PrefillWorkerStub(Security(token=token).channel(stack["prefill"]))
        err = rpc_error(lambda: prefill.GetWorkerInfo(worker_pb2.WorkerInfoRequest(), timeout=RPC_TIMEOUT_S))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, token
    # No page was taken; health probes stay open; the gateway (with the internal token) still serves.
    assert decode.GetWorkerInfo(worker_pb2.WorkerInfoRequest(), timeout=RPC_TIMEOUT_S).kv_blocks_free == free
    for address in (stack["decode"], stack["prefill"]):
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S).status == \
            health_pb2.HealthCheckResponse.SERVING
    text, final = stack["clients"]["a"].complete([3, 4, 5], max_tokens=4, ignore_eos=True, timeout=60)
    assert final.finish_reason == "length" and final.usage.completion_tokens == 4


class StandInWorker(grpc.GenericRpcHandler):
    """A gRPC server that answers every method UNAVAILABLE and records each call it gets, with
    whether it carried the internal token: what a fake worker registered in Redis would learn."""

    def __init__(self, internal_token: str):
        self.calls: list[tuple[str, bool]] = []
        self._bearer = "Bearer " + internal_token
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(2), handlers=[self])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def service(self, details):
        self.calls.append((details.method, dict(details.invocation_metadata).get("authorization") == self._bearer))

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAVAILABLE, "a stand-in")
        return grpc.unary_unary_rpc_method_handler(refuse)


def test_a_worker_record_without_the_internal_token_gets_no_request(stack):
    """Whoever can write to Redis but lacks the internal token cannot pose as a worker: records
    not signed with it (no key, another key, a real worker's signatures on another record) all
    point at a stand-in server that would be every gateway's first pick (the most free pages),
    yet it is never called, so it sees no prompt and no internal token; the gateway lists none
    of them, counts them in a metric, logs each, and serves on the real workers."""
    stand_in = StandInWorker(stack["tokens"]["internal"])
    redis_client = stack["redis"].client()
    unsigned = RedisState(redis_client)
    admin = stack["clients"]["admin"]
    real_id = next(w.worker_id for w in admin.server_info().workers if w.address == stack["decode"])
    real = next(w for w in unsigned.workers() if w["worker_id"] == real_id)
    # Colocated (no KV to move: no route to weigh) on the real workers' host, with the most free pages.
    stats = {**real["stats"], "kv_blocks_total": 10**6, "kv_blocks_free": 10**6}
    fakes = {"fake-unsigned": unsigned, "fake-other-key": RedisState(redis_client, registry_key=b"k" * 32)}
    try:
        for worker_id, writer in fakes.items():
            writer.register_worker(worker_id, "both", stand_in.address, real["transports"], stats, ttl_s=600)
        # Raw writes: the real decode worker's record, signatures and all, under another id and address.
        record = {**redis_client.hgetall(unsigned.worker_key(real_id)), b"address": stand_in.address.encode(),
                  b"role": b"both", b"stats": json.dumps(stats).encode()}
        redis_client.hset(unsigned.worker_key("fake-copied"), mapping=record)
        redis_client.set(unsigned.alive_key("fake-copied"), "1", px=600_000)
        redis_client.sadd(unsigned.workers_key, "fake-copied")
        fake_ids = {*fakes, "fake-copied"}

        def gateway_saw_them() -> bool:
            listed = {w.worker_id for w in admin.server_info().workers}
            logged = stack["gateway_log"].read_text()
            return bool(listed & fake_ids) or all(f"ignoring worker '{w}'" in logged for w in fake_ids)
        wait_until(gateway_saw_them, 30, "the gateway to read the forged records")
        results = []
        for i in range(3):
            try:
                results.append(stack["clients"]["a"].complete([3, 4, 5 + i], max_tokens=2, ignore_eos=True,
                                                              timeout=60)[1].finish_reason)
            except grpc.RpcError as e:
                results.append(e.code())
        assert stand_in.calls == [], f"a forged worker was called (method, with the internal token): {stand_in.calls}"
        assert results == ["length"] * 3
        assert not {w.worker_id for w in admin.server_info().workers} & fake_ids
        gateway_metrics = next(w.metrics_address for w in admin.server_info().workers if w.role == "gateway")
        assert scrape(gateway_metrics)["splitserve:untrusted_workers"] == len(fake_ids)
    finally:
        for worker_id in (*fakes, "fake-copied"):
            unsigned.deregister(worker_id)
        redis_client.close()
        stand_in.server.stop(None)


def _refused(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", *argv], capture_output=True, text=True,
                         timeout=120, env={**base, "PYTHONPATH": str(ROOT), **env})
    assert out.returncode != 0 and "serving on" not in out.stdout, out.stdout + out.stderr
    return out


def test_configurations_that_open_the_workers_to_clients_do_not_start(tiny_model_dirs):
    model = str(tiny_model_dirs["llama"])
    # A worker handed the clients' token (an old "same token everywhere" configuration).
    out = _refused(["decode", "--model", model, *DEFAULT_WORKER_ARGS], {"SPLITSERVE_AUTH_TOKEN": "client"})
    assert "--internal-token" in out.stderr
    # A gateway with client credentials but nothing to present to (and require at) the workers.
    gateway = ["gateway", "--model", model, "--redis-url", "redis://127.0.0.1:1/0", "--port", "0"]
    out = _refused(gateway, {"SPLITSERVE_AUTH_TOKEN": "client"})
    assert "--internal-token" in out.stderr
    # The internal token equal to a client's would let that client call the workers.
    out = _refused(gateway, {"SPLITSERVE_AUTH_TOKEN": "same", "SPLITSERVE_INTERNAL_TOKEN": "same"})
    assert "must differ" in out.stderr


def test_up_gives_one_internal_token_to_every_child_when_security_is_on(tmp_path):
    from splitserve.cli.commands import parse
    from splitserve.cli.up import plan

    def envs(argv, env):
        old = dict(os.environ)
        os.environ.update(env)
        try:
            specs = plan(parse(["up", "--prefill", "1", "--decode", "1", *argv]), "redis://127.0.0.1:1/0",
                         str(tmp_path))
        finally:
            os.environ.clear()
            os.environ.update(old)
        return {s.name: (s.env, s.argv) for s in specs if s.name != "redis"}

    secured = envs([], {"SPLITSERVE_AUTH_TOKEN": "client", "SPLITSERVE_ADMIN_TOKEN": "adm"})
    made = {env["SPLITSERVE_INTERNAL_TOKEN"] for env, _ in secured.values()}
    assert len(made) == 1 and made.pop() not in ("", "client", "adm")
    for name, (env, argv) in secured.items():
        assert ("SPLITSERVE_AUTH_TOKEN" in env) == ("SPLITSERVE_ADMIN_TOKEN" in env) == (name == "gateway"), name
        assert not {"client", "adm", env["SPLITSERVE_INTERNAL_TOKEN"]} & set(argv), name
    # One given is used as it is; without security none is made (workers as open as the gateway).
    given = envs([], {"SPLITSERVE_AUTH_TOKEN": "client", "SPLITSERVE_INTERNAL_TOKEN": "mine"})
    assert {env["SPLITSERVE_INTERNAL_TOKEN"] for env, _ in given.values()} == {"mine"}
    assert all("SPLITSERVE_INTERNAL_TOKEN" not in env for env, _ in envs([], {}).values())


def test_token_file_lines(tmp_path):
    from splitserve.common.security import read_token_file
    path = tmp_path / "tokens"
    path.write_text("# clients\n  alpha  \n\nbeta\n  # indented comment\n")
    assert read_token_file(str(path)) == ["alpha", "beta"]
    path.write_text("# nothing but comments\n")
    with pytest.raises(ValueError, match="holds no token"):
        read_token_file(str(path))
    with pytest.raises(ValueError, match="cannot read --token-file"):
        read_token_file(str(tmp_path / "missing"))


def test_only_the_admin_may_jump_the_queue(stack):
    """A priority below 0 goes ahead of every default request (issue 36, point 12): a client token
    asking for one is refused with PERMISSION_DENIED (HTTP 403), saying why; the admin may."""
    client, admin = stack["clients"]["a"], stack["clients"]["admin"]
    err = rpc_error(lambda: list(client.generate([5, 6, 7], max_tokens=2, temperature=0.0, priority=-5, timeout=30)))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "admin token" in err.details()
    assert list(client.generate([5, 6, 7], max_tokens=2, temperature=0.0, priority=3, timeout=30))
    assert list(admin.generate([5, 6, 7], max_tokens=2, temperature=0.0, priority=-5, timeout=30))
    refused = httpx.post(stack["http"] + "/v1/completions", timeout=30,
                         headers={"authorization": f"Bearer {stack['tokens']['a']}"},
                         json={"prompt": [5, 6, 7], "max_tokens": 2, "priority": -5})
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
    allowed = httpx.post(stack["http"] + "/v1/completions", timeout=30,
                         headers={"authorization": f"Bearer {stack['tokens']['admin']}"},
                         json={"prompt": [5, 6, 7], "max_tokens": 2, "priority": -5})
    assert allowed.status_code == 200, allowed.text
