"""compose.yaml, the Dockerfile and docs/deploy.md, checked without a Docker engine.

* compose.yaml is validated against the compose specification by a real validator
  (check-jsonschema's vendored compose-spec schema), raw and after interpolation.
* Every splitserve service's command and environment parse with ``splitserve.cli.parse()``,
  and every ``SPLITSERVE_*`` variable names a real flag (a typo would be silently ignored).
* The Dockerfile passes hadolint and, read with BuildKit's own parser, runs ``splitserve``.
* The ``cpu`` profile runs as local processes with the commands and environment of compose.yaml
  and serves a streamed request (see ``cpu_stack`` for the few substitutions one host needs).
* The sizing numbers in docs/deploy.md are what ``python -m splitserve.cli.sizing`` prints.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from splitserve.engine.model_loader import load_tokenizer
from splitserve.client import Client
from splitserve.cli.sizing import load_shape, pages_for
from tests.harness.deploy import parse_container
from splitserve.common.processes import die_with_parent, free_port
from tests.harness.redis_server import RedisServer
from tests.harness.tools import scrape

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
BIN = Path(sys.executable).parent
BOOT_TIMEOUT_S = 180
REQUIRED = {"SPLITSERVE_REDIS_PASSWORD": "test-password"}  # the one variable without a default


# ---------------------------------------------------------------------------- interpolation

_DOLLAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>.*))?", re.S)


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation: $$, $VAR, ${VAR}, ${VAR:-d}, ${VAR-d}, ${VAR:?e}, ${VAR?e},
    ${VAR:+a}, ${VAR+a}. Raises on anything else (so compose.yaml cannot drift past what this reads)."""
    def one(m: re.Match) -> str:
        if m["escaped"]:
            return "$"
        if m["named"]:
            return env.get(m["named"], "")
        braced = _BRACED.fullmatch(m["braced"])
        if braced is None:
            raise ValueError(f"invalid interpolation {m[0]!r}")
        value, op, arg = env.get(braced["name"]), braced["op"] or "", braced["arg"] or ""
        missing = value is None or (op.startswith(":") and value == "")
        if op.endswith("-"):
            return arg if missing else value
        if op.endswith("?"):
            if missing:
                raise ValueError(f"required variable {braced['name']}: {arg}")
            return value
        if op.endswith("+"):
            return "" if missing else arg
        return value or ""
    if "$" in _DOLLAR.sub("", text):
        raise ValueError(f"a '$' compose would reject in {text!r}")
    return _DOLLAR.sub(one, text)


def interpolated(node, env: dict[str, str]):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {k: interpolated(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolated(v, env) for v in node]
    return node


def load_compose(env: dict[str, str] | None = None) -> dict:
    """compose.yaml with its variables resolved (defaults unless ``env`` sets them)."""
    return interpolated(yaml.safe_load(COMPOSE.read_text()), {**REQUIRED, **(env or {})})


def splitserve_services(compose: dict) -> dict[str, dict]:
    """Services built from our Dockerfile (its ENTRYPOINT is `splitserve`)."""
    return {name: s for name, s in compose["services"].items() if "build" in s}


def in_profile(compose: dict, profile: str) -> dict[str, dict]:
    """What `docker compose --profile <profile> up` starts: services without profiles, plus the profile's."""
    return {n: s for n, s in compose["services"].items() if not s.get("profiles") or profile in s["profiles"]}


def seconds(duration: str) -> float:
    units = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))


# ---------------------------------------------------------------------------- the compose file


def check_jsonschema(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_compose_file_follows_the_compose_specification(tmp_path):
    raw = check_jsonschema(COMPOSE)
    assert raw.returncode == 0, raw.stdout + raw.stderr
    # After interpolation too: the values compose would hand the engine must still fit the schema.
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(yaml.safe_dump(load_compose(), sort_keys=False))
    result = check_jsonschema(resolved)
    assert result.returncode == 0, result.stdout + result.stderr
    # The validator does catch mistakes: a misspelled key must fail it.
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["gateway"]["helthcheck"] = broken["services"]["gateway"].pop("healthcheck")
    bad = tmp_path / "broken.yaml"
    bad.write_text(yaml.safe_dump(broken))
    result = check_jsonschema(bad)
    assert result.returncode != 0 and "helthcheck" in result.stdout


@pytest.mark.parametrize("name", sorted(splitserve_services(load_compose())))
def test_service_command_and_environment_parse(name):
    service = load_compose()["services"][name]
    env = {k: str(v) for k, v in service["environment"].items()}
    args = parse_container(service["command"], env, name)
    # The health check dials SPLITSERVE_HOST:SPLITSERVE_PORT: a fixed port, not 0 (a random one).
    assert args.port > 0


def test_compose_layout():
    compose = load_compose()
    services = compose["services"]
    redis = services["redis"]
    assert "ports" not in redis, "Redis must not be published"
    argv = redis["command"]
    assert argv[argv.index("--appendonly") + 1] == "yes"
    assert argv[argv.index("--requirepass") + 1] == REQUIRED["SPLITSERVE_REDIS_PASSWORD"]
    published = {p.rsplit(":", 1)[1] for p in services["gateway"]["ports"]}
    env = services["gateway"]["environment"]
    assert published == {env["SPLITSERVE_PORT"], env["SPLITSERVE_METRICS_PORT"], env["SPLITSERVE_HTTP_PORT"]}
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", name
        assert service["healthcheck"]["test"], name
        if name in splitserve_services(compose):
            kind, python, flag, script, *service_name = service["healthcheck"]["test"]
            assert (kind, python, flag) == ("CMD", "python", "-c") and "grpc_health" in script, name
            # The gateway's check is its readiness (healthy = can serve a request); a worker's is
            # its liveness (a restart acts on it, and a draining worker must not be restarted).
            assert service_name == (["splitserve.v1.Generation"] if name == "gateway" else []), name
            # Compose's stop timeout must outlast the drain, or in-flight requests are killed.
            assert seconds(service["stop_grace_period"]) > float(service["environment"]["SPLITSERVE_DRAIN_TIMEOUT_S"])
    # cpu: the decode pool is a file in /dev/shm, shared with prefill through the IPC namespace.
    cpu = in_profile(compose, "cpu")
    assert {"redis", "gateway", "prefill", "decode"} == set(cpu)
    assert cpu["decode"]["ipc"] == "shareable" and cpu["prefill"]["ipc"] == "service:decode"
    shm = cpu["decode"]["shm_size"]
    assert shm.endswith("gb") and float(shm[:-2]) > float(cpu["decode"]["environment"]["SPLITSERVE_KV_CACHE_MEMORY_GB"])
    # gpu profiles: pairs on disjoint GPUs, each prefill in its decode's IPC and PID namespaces.
    for profile, pairs in (("gpu", 1), ("gpu-4", 2), ("gpu-8", 4)):
        workers = {n: s for n, s in in_profile(compose, profile).items() if n not in ("redis", "gateway")}
        assert len(workers) == 2 * pairs, profile
        gpus = []
        for k in range(pairs):
            decode, prefill = workers[f"decode-{k}"], workers[f"prefill-{k}"]
            assert decode["ipc"] == "shareable"
            assert prefill["ipc"] == prefill["pid"] == f"service:decode-{k}"
            devices = [d["deploy"]["resources"]["reservations"]["devices"][0] for d in (decode, prefill)]
            assert devices[0] == devices[1] and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
            gpus += devices[0]["device_ids"]
            assert {decode["environment"]["SPLITSERVE_DEVICE"], prefill["environment"]["SPLITSERVE_DEVICE"]} == \
                {"cuda:0", "cuda:1"}
        assert len(gpus) == len(set(gpus)) == 2 * pairs, (profile, gpus)
    # gpu-shared: prefill and decode on one GPU, memory shares that fit it, KV over CUDA IPC (not nccl).
    workers = {n: s for n, s in in_profile(compose, "gpu-shared").items() if n not in ("redis", "gateway")}
    decode, prefill = workers.pop("decode-shared"), workers.pop("prefill-shared")
    assert not workers
    assert decode["ipc"] == "shareable" and prefill["ipc"] == prefill["pid"] == "service:decode-shared"
    devices = [s["deploy"]["resources"]["reservations"]["devices"] for s in (decode, prefill)]
    assert devices[0] == devices[1] and len(devices[0]) == 1 and len(devices[0][0]["device_ids"]) == 1
    envs = [s["environment"] for s in (decode, prefill)]
    assert {e["SPLITSERVE_DEVICE"] for e in envs} == {"cuda:0"}
    shares = [float(e["SPLITSERVE_GPU_MEMORY_UTILIZATION"]) for e in envs]
    assert shares[0] > shares[1] > 0 and sum(shares) <= 0.95
    for e in envs:
        transports = e["SPLITSERVE_KV_TRANSPORT"].split(",")
        assert transports[0] == "cuda_ipc" and "nccl" not in transports
    # TLS and auth pass through, off when unset; client and admin tokens reach the gateway only
    # (a worker refuses them), the internal token every process.
    for name in splitserve_services(compose):
        env = services[name]["environment"]
        for var in ("SPLITSERVE_TLS_CERT", "SPLITSERVE_TLS_KEY", "SPLITSERVE_TLS_CA", "SPLITSERVE_INTERNAL_TOKEN"):
            assert env[var] == "", (name, var)
        if name != "gateway":
            assert not {"SPLITSERVE_AUTH_TOKEN", "SPLITSERVE_ADMIN_TOKEN"} & set(env), name
    assert services["gateway"]["environment"]["SPLITSERVE_AUTH_TOKEN"] == ""
    assert services["gateway"]["environment"]["SPLITSERVE_ADMIN_TOKEN"] == ""
    given = load_compose({"SPLITSERVE_AUTH_TOKEN": "t", "SPLITSERVE_ADMIN_TOKEN": "a",
                          "SPLITSERVE_INTERNAL_TOKEN": "i"})["services"]
    assert given["gateway"]["environment"]["SPLITSERVE_AUTH_TOKEN"] == "t"
    assert given["gateway"]["environment"]["SPLITSERVE_ADMIN_TOKEN"] == "a"
    assert given["decode"]["environment"]["SPLITSERVE_INTERNAL_TOKEN"] == "i"
    assert "SPLITSERVE_AUTH_TOKEN" not in given["decode"]["environment"]
    with pytest.raises(ValueError, match="SPLITSERVE_REDIS_PASSWORD"):
        interpolated(yaml.safe_load(COMPOSE.read_text()), {})


# Tensor-parallel profiles: profile -> (pairs, --tensor-parallel-size of every worker in it).
TP_PROFILES = {"gpu-tp2": (1, 2), "gpu-tp2-8": (2, 2), "gpu-tp4": (1, 4)}


def compute_gpus(service: dict, tensor_parallel_size: int) -> list[str]:
    """Host GPU ids a worker's ranks compute on: rank r of a worker on cuda:K runs on the container's
    cuda:K+r, the (K+r)-th of its reserved devices (CUDA_DEVICE_ORDER=PCI_BUS_ID keeps their order)."""
    [devices] = service["deploy"]["resources"]["reservations"]["devices"]
    first = int(service["environment"]["SPLITSERVE_DEVICE"].removeprefix("cuda:"))
    ranks = range(first, first + tensor_parallel_size)
    assert ranks[-1] < len(devices["device_ids"]), "a rank past the GPUs the container sees"
    return [devices["device_ids"][k] for k in ranks]


@pytest.mark.parametrize("profile", sorted(TP_PROFILES))
def test_tensor_parallel_profiles(profile):
    """Each TP pair: the same --tensor-parallel-size on both sides, each worker's ranks on as many
    GPUs as that size, prefill and decode on different GPUs, both containers seeing the pair's GPUs
    (cuda_ipc between ranks) in one IPC/PID namespace; pairs on disjoint GPUs."""
    pairs, tp = TP_PROFILES[profile]
    compose = load_compose()
    workers = {n: s for n, s in in_profile(compose, profile).items() if n not in ("redis", "gateway")}
    assert set(workers) == {f"{role}-tp{tp}-{k}" for role in ("prefill", "decode") for k in range(pairs)}
    sizes, used = set(), []
    for k in range(pairs):
        decode, prefill = workers[f"decode-tp{tp}-{k}"], workers[f"prefill-tp{tp}-{k}"]
        for name, service in ((f"decode-tp{tp}-{k}", decode), (f"prefill-tp{tp}-{k}", prefill)):
            env = {key: str(v) for key, v in service["environment"].items()}
            args = parse_container(service["command"], env, name)  # the CLI reads the size as the worker will
            sizes.add(args.tensor_parallel_size)
        assert prefill["ipc"] == prefill["pid"] == f"service:decode-tp{tp}-{k}" and decode["ipc"] == "shareable"
        assert prefill["deploy"] == decode["deploy"]
        [devices] = decode["deploy"]["resources"]["reservations"]["devices"]
        assert devices["driver"] == "nvidia" and "gpu" in devices["capabilities"]
        prefill_gpus, decode_gpus = compute_gpus(prefill, tp), compute_gpus(decode, tp)
        assert len(set(prefill_gpus)) == len(set(decode_gpus)) == tp
        # Together the pair's two workers compute on exactly the GPUs it reserves, none twice.
        assert sorted(prefill_gpus + decode_gpus) == sorted(devices["device_ids"]) and \
            not set(prefill_gpus) & set(decode_gpus)
        used += devices["device_ids"]
    assert sizes == {tp}, f"{profile}: prefill and decode must have the same tensor-parallel size, got {sizes}"
    assert len(used) == len(set(used)) == 2 * tp * pairs <= 8, (profile, used)


def test_tensor_parallel_profiles_are_documented():
    header = COMPOSE.read_text().split("\nname:", 1)[0]
    doc = (ROOT / "docs" / "deploy.md").read_text()
    for profile in TP_PROFILES:
        assert f"--profile {profile} " in header and f"`{profile}`" in doc, profile


def bind_mounts(service: dict) -> dict[str, str]:
    """Host path (relative to the repository) -> container path of a service's bind mounts."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("./"):
            mounts[source[2:]] = target
    return mounts


def test_observability_profile_scrapes_every_splitserve_process_and_provisions_grafana():
    compose = load_compose()
    services = compose["services"]
    added = set(in_profile(compose, "observability")) - set(in_profile(compose, "no-such-profile"))
    assert added == {"prometheus", "grafana"}
    prometheus, grafana = services["prometheus"], services["grafana"]
    for service in (prometheus, grafana):
        for source in bind_mounts(service):
            assert (ROOT / source).exists(), source  # compose would mount an empty directory instead
    assert set(compose["volumes"]) >= {"prometheus-data", "grafana-data"}
    # Host ports stay distinct across every profile (the gateway's /metrics is published on 9090).
    published = [p.split(":")[-2] for s in services.values() for p in s.get("ports", [])]
    assert len(published) == len(set(published)), published
    # Prometheus: the config it is given names every splitserve service, at its metrics port.
    config_path = next(p for p, target in bind_mounts(prometheus).items()
                       if target == "/etc/prometheus/prometheus.yml")
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    config = yaml.safe_load((ROOT / config_path).read_text())
    [job] = config["scrape_configs"]
    [dns] = job["dns_sd_configs"]
    assert dns["type"] == "A"
    splitserve = splitserve_services(compose)
    assert set(dns["names"]) == set(splitserve)
    for name, service in splitserve.items():
        assert int(service["environment"]["SPLITSERVE_METRICS_PORT"]) == dns["port"], name
    # Grafana: the data source is that Prometheus (service name, container port); the dashboards
    # provider reads the directory the dashboard JSON is mounted at, and the JSON uses the source.
    mounts = bind_mounts(grafana)
    provisioning = ROOT / next(p for p, t in mounts.items() if t == "/etc/grafana/provisioning")
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    container_port = prometheus["ports"][0].rsplit(":", 1)[1]
    assert source["type"] == "prometheus" and source["url"] == f"http://prometheus:{container_port}"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "splitserve.yaml").read_text())["providers"]
    dashboards = next(p for p, t in mounts.items() if t == provider["options"]["path"])
    dashboard = json.loads((ROOT / dashboards / "splitserve.json").read_text())
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == \
        f"{provider['options']['path']}/splitserve.json"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"


def grafana_admin_password(compose: dict, data: Path) -> subprocess.CompletedProcess:
    """Run compose's grafana entrypoint here, the image's own (/run.sh) replaced by a print of the
    admin password Grafana would get; ``data``: the data volume (GF_PATHS_DATA, from the image)."""
    grafana = compose["services"]["grafana"]
    shell, script, *image_entrypoint = grafana["entrypoint"]
    assert image_entrypoint == ["/run.sh"]  # the grafana image's ENTRYPOINT, run after the script
    script = next(source for source, target in bind_mounts(grafana).items() if target == script)
    env = {**{k: str(v) for k, v in grafana["environment"].items()}, "GF_PATHS_DATA": str(data),
           "PATH": os.environ["PATH"]}
    show = [sys.executable, "-c", "import os; print(os.environ.get('GF_SECURITY_ADMIN_PASSWORD', ''))"]
    return subprocess.run([shell, str(ROOT / script), *show], env=env, capture_output=True, text=True,
                          timeout=30, check=True)


def test_grafana_admin_password_has_no_fixed_default(tmp_path):
    """Issue 36, point 12: with SPLITSERVE_GRAFANA_PASSWORD unset, Grafana's admin password is no
    string compose.yaml holds (it was admin / admin) but a random one made at the first start,
    kept in the data volume for later starts and for the user to read; when set, it is used."""
    compose = load_compose()
    assert compose["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == ""
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir(), other.mkdir()
    password = grafana_admin_password(compose, first).stdout.splitlines()[-1]
    assert len(password) >= 32 and password not in COMPOSE.read_text()
    assert (first / "admin-password").read_text() == password
    assert (first / "admin-password").stat().st_mode & 0o077 == 0  # Grafana's user only
    assert grafana_admin_password(compose, first).stdout.splitlines()[-1] == password  # kept
    assert grafana_admin_password(compose, other).stdout.splitlines()[-1] not in (password, "")  # random
    chosen = load_compose({"SPLITSERVE_GRAFANA_PASSWORD": "chosen-password"})
    given = tmp_path / "given"
    given.mkdir()
    assert grafana_admin_password(chosen, given).stdout.splitlines() == ["chosen-password"]
    assert not (given / "admin-password").exists()
    # A data volume from before (a database, no password file): Grafana keeps the admin password
    # in its database, so none is made (it would not be Grafana's); the log says how to set one.
    old = tmp_path / "old"
    old.mkdir()
    (old / "grafana.db").write_bytes(b"")
    result = grafana_admin_password(compose, old)
    assert not (old / "admin-password").exists() and "reset-admin-password" in result.stderr


def health_check_argv(service: dict, service_name: str | None = None) -> dict:
    """``service`` with its health check asking ``service_name`` instead (None: as compose.yaml has it)."""
    check = dict(service["healthcheck"])
    if service_name is not None:
        check["test"] = check["test"][:4] + ([service_name] if service_name else [])
    return {**service, "healthcheck": check}


def test_gateway_health_check_is_readiness(tiny_model_dirs, tmp_path):
    """compose's gateway check fails while the gateway is alive but cannot serve (Redis up, no
    worker registered), where a liveness check of the same process passes."""
    password = secrets.token_hex(8)
    compose = load_compose({"SPLITSERVE_MODEL": str(tiny_model_dirs["llama"]), "SPLITSERVE_REDIS_PASSWORD": password})
    service = compose["services"]["gateway"]
    redis_server = RedisServer(password=password).start()
    env = {k: str(v) for k, v in service["environment"].items()}
    env.update(SPLITSERVE_HOST="127.0.0.1", SPLITSERVE_PORT=str(free_port()), SPLITSERVE_METRICS_PORT="-1",
               SPLITSERVE_HTTP_PORT="-1",
               SPLITSERVE_REDIS_URL=urlsplit(env["SPLITSERVE_REDIS_URL"])._replace(
                   netloc=f"127.0.0.1:{redis_server.port}").geturl())
    gateway = Process("gateway-alone", service["command"], env, tmp_path)
    try:
        gateway.wait_serving()
        assert run_healthcheck(health_check_argv(service, ""), env)  # alive
        assert not run_healthcheck(service, env)  # not ready: no worker
    finally:
        gateway.stop()
        redis_server.close()


def test_dockerfile_lints_clean_and_runs_splitserve():
    import dockerfile
    lint = subprocess.run([str(BIN / "hadolint"), "--failure-threshold", "info", str(ROOT / "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    commands = dockerfile.parse_file(str(ROOT / "Dockerfile"))  # BuildKit's parser
    assert [c.value for c in commands if c.cmd == "ENTRYPOINT"][-1] == ("splitserve",)
    copied = {Path(c.value[0]).name for c in commands if c.cmd == "COPY"}
    packages = yaml.safe_load(re.search(r"include = (\[.*?\])", (ROOT / "pyproject.toml").read_text())[1])
    assert {p.rstrip("*") for p in packages} <= copied
    # Every copied path is let into the build context (.dockerignore is an allow-list).
    allowed = {line[1:].strip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert copied <= allowed, copied - allowed
    # Every service builds from this Dockerfile with a base and torch index it accepts.
    args = {c.value[0].split("=")[0] for c in commands if c.cmd == "ARG"}
    for name, service in splitserve_services(load_compose()).items():
        assert set(service["build"].get("args", {})) <= args, name


# ---------------------------------------------------------------------------- docs/deploy.md


def sizing_examples() -> list[tuple[str, str]]:
    """(command, output) of each `$ python -m splitserve.cli.sizing ...` block in docs/deploy.md."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    examples = []
    for block in re.findall(r"```console\n(.*?)```", text, re.S):
        if block.startswith("$ python -m splitserve.cli.sizing"):
            command, _, output = block.replace("\\\n", " ").partition("\n")
            examples.append((command[2:], output.strip()))
    return examples


def test_deploy_doc_sizing_numbers_are_the_commands_output():
    examples = sizing_examples()
    assert len(examples) >= 3  # the default model, and Llama-3 8B/70B shapes
    for command, shown in examples:
        argv = [sys.executable, *shlex.split(command)[1:]]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == shown, command


# ---------------------------------------------------------------------------- the cpu profile, run locally


def start_order(services: dict[str, dict]) -> list[str]:
    """Dependencies first, as compose starts them."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name not in order:
            for dep in services[name].get("depends_on", {}):
                visit(dep)
            order.append(name)
    for name in sorted(services):
        visit(name)
    return order


class Process:
    """A splitserve process started with a service's command and environment."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: Path):
        self.name, self.env = name, env
        self.log = open(log_dir / f"{name}.log", "w")
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
        child_env.update(env, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", *command], stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=child_env, cwd=ROOT,
                                     preexec_fn=die_with_parent(signal.SIGKILL))
        self.serving = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if "serving on" in line:
                self.serving.set()

    def wait_serving(self) -> None:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while not self.serving.wait(0.2):  # a process that exited is not waited for to the end
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start (exit {self.proc.poll()}); see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(45)  # the drain timeout (30 s) and a margin, like stop_grace_period
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def run_healthcheck(service: dict, env: dict[str, str]) -> bool:
    check = service["healthcheck"]
    kind, *argv = check["test"]
    if kind == "CMD-SHELL":
        argv = ["sh", "-c", argv[0]]
    if argv[0] == "python":  # the image's python is this one
        argv[0] = sys.executable
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    try:
        return subprocess.run(argv, env={**child_env, **env}, capture_output=True,
                              timeout=seconds(check["timeout"]) + 10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def wait_healthy(name: str, service: dict, env: dict[str, str], proc: Process | None) -> None:
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while not run_healthcheck(service, env):
        if proc is not None and proc.proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.proc.returncode}; see {proc.log.name}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not healthy within {BOOT_TIMEOUT_S} s")
        time.sleep(seconds(service["healthcheck"].get("start_interval", "1s")))


@pytest.fixture(scope="module")
def cpu_stack(tiny_model_dirs, tmp_path_factory):
    """`docker compose --profile cpu up` as local processes. What differs, and only that:
    * the model: SPLITSERVE_MODEL (a compose variable, as a user would set it) is the tiny test model;
    * hosts: service names (and 0.0.0.0) become 127.0.0.1: one host, no compose DNS;
    * ports: each container's fixed ports become free ports (containers each own a port space);
    * Redis: the compose command runs as given, with a port, bind address and data dir added; its
      health check (redis-cli on the default port) is replaced by RedisServer's own PING wait;
    * the health checks' `python` is this interpreter;
    * ipc/pid sharing: local processes share one IPC namespace (and /dev/shm) anyway.
    """
    model = str(tiny_model_dirs["llama"])
    password = secrets.token_hex(8)
    compose = load_compose({"SPLITSERVE_MODEL": model, "SPLITSERVE_REDIS_PASSWORD": password})
    services = in_profile(compose, "cpu")
    names = set(services)
    redis_port: int | None = None
    envs: dict[str, dict[str, str]] = {}
    procs: dict[str, Process] = {}
    redis_server = None
    log_dir = tmp_path_factory.mktemp("compose-logs")
    try:
        for name in start_order(services):
            service = services[name]
            for dep, how in service.get("depends_on", {}).items():
                # Redis is up once RedisServer.start() returns (it waits for PING with the password).
                if how.get("condition") == "service_healthy" and dep != "redis":
                    wait_healthy(dep, services[dep], envs[dep], procs.get(dep))
            if name == "redis":
                argv = service["command"]
                assert argv[0] == "redis-server"
                redis_server = RedisServer(password=password, extra_args=tuple(argv[1:]),
                                           dir=tmp_path_factory.mktemp("redis-data")).start()
                redis_port = redis_server.port
                envs[name] = {k: str(v) for k, v in service["environment"].items()}
                continue
            env = {k: str(v) for k, v in service["environment"].items()}
            if env.get("SPLITSERVE_HOST") in names | {"0.0.0.0"}:
                env["SPLITSERVE_HOST"] = "127.0.0.1"
            for key in ("SPLITSERVE_PORT", "SPLITSERVE_METRICS_PORT", "SPLITSERVE_HTTP_PORT"):
                if int(env.get(key, "-1")) > 0:
                    env[key] = str(free_port())
            url = urlsplit(env["SPLITSERVE_REDIS_URL"])
            assert url.hostname == "redis" and url.port == 6379
            env["SPLITSERVE_REDIS_URL"] = url._replace(netloc=f"127.0.0.1:{redis_port}").geturl()
            envs[name] = env
            procs[name] = Process(name, service["command"], env, log_dir)
            procs[name].wait_serving()
        yield {"compose": compose, "services": services, "envs": envs, "procs": procs, "redis": redis_server,
               "model": model, "address": f"127.0.0.1:{envs['gateway']['SPLITSERVE_PORT']}", "logs": log_dir}
    finally:
        for name in reversed(list(procs)):
            procs[name].stop()
        if redis_server is not None:
            redis_server.close()


def test_cpu_profile_health_checks_pass(cpu_stack):
    # The gateway's check passes only once Redis answers and a prefill + decode pair registered.
    for name, service in cpu_stack["services"].items():
        if name != "redis":
            wait_healthy(name, service, cpu_stack["envs"][name], cpu_stack["procs"][name])
    redis = cpu_stack["redis"].client()
    assert redis.config_get("appendonly")["appendonly"] == "yes"  # compose's Redis flags took effect
    redis.close()


def test_cpu_profile_serves_a_streamed_request(cpu_stack, hf_reference):
    wait_healthy("gateway", cpu_stack["services"]["gateway"], cpu_stack["envs"]["gateway"],
                 cpu_stack["procs"]["gateway"])
    prompt = [40 + i % 50 for i in range(23)]  # token ids of the tiny byte-level model
    with Client(cpu_stack["address"]) as client:
        events = list(client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True, timeout=120))
        info = client.server_info()
    chunks, final = events[:-1], events[-1]
    assert final.finished and final.finish_reason == "length" and final.usage.completion_tokens == 12
    assert len(chunks) >= 2 and not any(e.finished for e in chunks)  # streamed, not one reply
    tokens = [t for e in chunks for t in e.token_ids]
    assert tokens == hf_reference(Path(cpu_stack["model"])).greedy(prompt, 12)
    assert "".join(e.text for e in chunks)
    assert final.timeline.prefill_worker and final.timeline.decode_worker  # disaggregated, not colocated
    # The KV crossed over shm: the decode pool in shared memory, as ipc: service:decode arranges.
    samples = scrape(int(cpu_stack["envs"]["prefill"]["SPLITSERVE_METRICS_PORT"]))
    assert samples.get("splitserve:kv_transfer_bytes_total{transport=shm}", 0) > 0, "no KV went over shm"
    # The pools hold what python -m splitserve.cli.sizing computes for the same settings.
    shape = load_shape(cpu_stack["model"])
    for worker in info.workers:
        if worker.role in ("prefill", "decode"):
            env = cpu_stack["envs"][worker.role]
            assert worker.kv_blocks_total == pages_for(float(env["SPLITSERVE_KV_CACHE_MEMORY_GB"]), shape,
                                                       env["SPLITSERVE_DTYPE"], int(env["SPLITSERVE_BLOCK_SIZE"]))


def test_interpolation_follows_compose_rules():
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $SET $$HOME", env) == "v d  d v $HOME"
    assert interpolate("${SET:+a}|${EMPTY:+a}|${EMPTY+a}", env) == "a||a"
    with pytest.raises(ValueError, match="need it"):
        interpolate("${EMPTY:?need it}", env)
    assert interpolate("${EMPTY?unused}", env) == ""
    with pytest.raises(ValueError):
        interpolate("cost: $5", env)



def test_cpu_profile_serves_the_openai_http_api(cpu_stack, hf_reference):
    """The gateway's compose environment turns the HTTP API on: a greedy completion of token ids."""
    wait_healthy("gateway", cpu_stack["services"]["gateway"], cpu_stack["envs"]["gateway"],
                 cpu_stack["procs"]["gateway"])
    base = f"http://127.0.0.1:{cpu_stack['envs']['gateway']['SPLITSERVE_HTTP_PORT']}"
    with urllib.request.urlopen(base + "/health", timeout=10) as response:
        assert response.status == 200
    prompt = [40 + i % 50 for i in range(17)]
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                       "logprobs": 0}).encode()
    request = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["finish_reason"] == "length"
    want = hf_reference(Path(cpu_stack["model"])).greedy(prompt, 8)
    tokenizer = load_tokenizer(Path(cpu_stack["model"]))
    assert answer["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in want]
