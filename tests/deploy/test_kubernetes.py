"""deploy/kubernetes, checked without a cluster.

* ``render`` builds each kustomization (base, tls) as ``kubectl apply -k`` would: the resources it
  lists and its JSON 6902 patches; any other kustomize feature is refused, so the renderer cannot
  silently skip one. Where kubectl is installed its own kustomize must agree.
* Every object validates against the Kubernetes API's OpenAPI schema (kubernetes-validate, strict:
  an unknown field is an error), offline; a misspelled field and a wrong type are shown rejected.
* checkov's Kubernetes checks pass on the files and on the rendered tls overlay (skips only with a
  reason, in the manifests), and a privileged container is shown to fail them.
* Every splitserve container's args and environment parse with ``splitserve.cli.parse()`` (the
  same helper as compose's test), Secrets and ConfigMaps resolved as the kubelet would.
* What a user relies on: two gateways, readiness against liveness, termination grace against the
  drain timeout (the CLI's own default), GPUs, the PDB's selector, the Secrets docs/deploy.md creates.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import click
import pytest
import yaml

from splitserve.cli.flags import BY_NAME
from splitserve.common.grpc_server import GENERATION, LIVENESS
from tests.harness.deploy import parse_container

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
VARIANTS = ("base", "tls", "autoscaling")
NAMESPACE = "splitserve"
SPLITSERVE_IMAGES = {"splitserve:cpu", "splitserve:cuda"}
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# Kubernetes releases the manifests must be valid for: native gRPC probes are GA since 1.27.
K8S_VERSIONS = ("1.27", "latest")
# The only checkov checks the manifests skip, each with its reason in an annotation.
ALLOWED_SKIPS = {"CKV_K8S_43", "CKV_K8S_35"}
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing_tool(what: str, how: str):
    """A tool the test needs is absent: a failure in CI (`make test` installs it), else a skip saying so."""
    message = f"{what} is not installed; `{how}` installs it"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


# ---------------------------------------------------------------------------- rendering


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pointer(path: str) -> list[str]:
    assert path.startswith("/"), path
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 add, remove and replace (what the overlays use); anything else is refused."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "add":
            if isinstance(node, list):
                node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
            else:
                node[last] = copy.deepcopy(op["value"])
        elif op["op"] in ("remove", "replace"):
            key = int(last) if isinstance(node, list) else last
            node[key]  # must exist (KeyError/IndexError otherwise), as RFC 6902 says
            if op["op"] == "remove":
                del node[key]
            else:
                node[key] = copy.deepcopy(op["value"])
        else:
            raise ValueError(f"unsupported patch op {op['op']!r}")
    return doc


def _matches(target: dict, doc: dict) -> bool:
    unknown = set(target) - {"kind", "name"}
    assert not unknown, f"patch target fields this renderer does not implement: {unknown}"
    return all(re.fullmatch(target[field], value) for field, value in
               (("kind", doc["kind"]), ("name", doc["metadata"]["name"])) if field in target)


def render(directory: Path) -> list[dict]:
    """The objects ``kubectl apply -k <directory>`` would apply."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {"apiVersion", "kind", "resources", "patches"}
    assert not unknown, f"{directory}: kustomize features this renderer does not implement: {unknown}"
    docs: list[dict] = []
    for resource in kustomization["resources"]:
        path = directory / resource
        docs += render(path) if path.is_dir() else load_docs(path)
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"target", "patch"}, patch
        hits = [i for i, doc in enumerate(docs) if _matches(patch["target"], doc)]
        assert hits, f"{directory}: patch target {patch['target']} matches nothing"
        for i in hits:
            docs[i] = json_patch(docs[i], yaml.safe_load(patch["patch"]))
    keys = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), f"{directory}: an object twice"
    return docs


RENDERED = {variant: render(KUBE / variant) for variant in VARIANTS}


def objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in WORKLOAD_KINDS}


def splitserve_containers(docs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """Workload name -> (workload, container) of every container running the splitserve image."""
    found = {}
    for name, workload in workloads(docs).items():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if container["image"] in SPLITSERVE_IMAGES:
                found[name] = (workload, container)
    return found


def test_every_manifest_file_is_in_a_kustomization():
    listed = {(KUBE / v / r).resolve() for v in VARIANTS
              for r in yaml.safe_load((KUBE / v / "kustomization.yaml").read_text())["resources"]}
    files = {p.resolve() for p in KUBE.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert files <= listed, f"not applied by any kustomization: {sorted(map(str, files - listed))}"
    for docs in RENDERED.values():
        for doc in docs:
            if doc["kind"] != "Namespace":
                assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]


def test_renderer_agrees_with_kubectl_kustomize():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the renderer's output is not compared with kustomize's own")
    for variant in VARIANTS:
        result = subprocess.run([kubectl, "kustomize", str(KUBE / variant)], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
        theirs = sorted((d for d in yaml.safe_load_all(result.stdout) if d), key=key)
        assert theirs == sorted(RENDERED[variant], key=key), variant


def test_renderer_patches_as_rfc_6902_says():
    doc = {"a": {"b": [1, 2]}, "c": 1}
    ops = [{"op": "add", "path": "/a/b/-", "value": 3}, {"op": "add", "path": "/a/b/0", "value": 0},
           {"op": "replace", "path": "/c", "value": 2}, {"op": "remove", "path": "/a/b/1"},
           {"op": "add", "path": "/d~1e", "value": {}}]
    assert json_patch(doc, ops) == {"a": {"b": [0, 2, 3]}, "c": 2, "d/e": {}}
    with pytest.raises(KeyError):
        json_patch(doc, [{"op": "replace", "path": "/missing", "value": 1}])


# ---------------------------------------------------------------------------- the API schema


def kubernetes_validate():
    try:
        import kubernetes_validate
    except ImportError:
        missing_tool("kubernetes-validate", "make install")
    return kubernetes_validate


def schema_errors(doc: dict) -> list[str]:
    kv = kubernetes_validate()
    errors = []
    for version in K8S_VERSIONS:
        version = kv.utils.latest_version() if version == "latest" else version
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            errors.append(f"{version}: {doc['kind']} {doc['metadata']['name']}: {e.message} at {list(e.path)}")
    return errors


@pytest.mark.parametrize("variant", VARIANTS)
def test_manifests_follow_the_kubernetes_api_schema(variant):
    errors = [e for doc in RENDERED[variant] for e in schema_errors(doc)]
    assert not errors, "\n".join(errors)


def test_schema_validation_rejects_mistakes():
    gateway = objects(RENDERED["base"], "Deployment")["gateway"]
    assert not schema_errors(gateway)
    misspelled = copy.deepcopy(gateway)
    container = misspelled["spec"]["template"]["spec"]["containers"][0]
    container["readynessProbe"] = container.pop("readinessProbe")
    assert any("readynessProbe" in e for e in schema_errors(misspelled))
    wrong_type = copy.deepcopy(gateway)
    wrong_type["spec"]["replicas"] = "two"
    assert any("replicas" in e for e in schema_errors(wrong_type))
    grpc_probe = copy.deepcopy(gateway)
    grpc_probe["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["port"] = "grpc"
    assert schema_errors(grpc_probe), "a gRPC probe's port must be a number (named ports are not allowed)"


# ---------------------------------------------------------------------------- checkov


def checkov_binary() -> str:
    for candidate in (os.environ.get("CHECKOV"), ROOT / ".venv-checkov" / "bin" / "checkov", shutil.which("checkov")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    missing_tool("checkov", "make checkov")


def checkov(*target: str) -> dict:
    """checkov's Kubernetes report (JSON) on ``target`` (-d DIR or -f FILE...), offline."""
    result = subprocess.run([checkov_binary(), *target, "--framework", "kubernetes", "--skip-download",
                             "--output", "json"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"})
    start = result.stdout.find("{")
    assert start >= 0, f"checkov printed no report (exit {result.returncode}):\n{result.stdout}\n{result.stderr}"
    report = json.loads(result.stdout[start:])
    report = report[0] if isinstance(report, list) else report
    assert report["check_type"] == "kubernetes"
    assert result.returncode == (1 if report["summary"]["failed"] else 0), result.stderr
    return report


def failures(report: dict) -> list[str]:
    return [f"{c['check_id']} {c['check_name']}: {c['resource']} ({c['file_path']})"
            for c in report["results"]["failed_checks"]]


def test_checkov_passes_with_reasoned_skips_only(tmp_path):
    report = checkov("-d", str(KUBE.relative_to(ROOT)))
    summary = report["summary"]
    assert summary["parsing_errors"] == 0 and summary["passed"] > 100, summary
    assert not failures(report), "\n".join(failures(report))
    skipped = report["results"]["skipped_checks"]
    assert {c["check_id"] for c in skipped} <= ALLOWED_SKIPS
    assert all(len(c["check_result"]["suppress_comment"]) > 20 for c in skipped), "every skip says why"
    # The tls overlay as applied (checkov reads no kustomization), and proof that checkov does fail
    # a bad manifest: the gateway running privileged.
    rendered = tmp_path / "tls.yaml"
    rendered.write_text(yaml.safe_dump_all(RENDERED["tls"], sort_keys=False))
    bad = copy.deepcopy(objects(RENDERED["base"], "Deployment")["gateway"])
    bad["metadata"]["name"] = "bad"
    bad["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privileged"] = True
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    report = checkov("-d", str(tmp_path))
    assert report["summary"]["parsing_errors"] == 0
    failed = report["results"]["failed_checks"]
    assert failed and {Path(c["file_path"]).name for c in failed} == {"bad.yaml"}, "\n".join(failures(report))
    assert "CKV_K8S_16" in {c["check_id"] for c in failed}  # "Container should not be privileged"
    assert {c["check_id"] for c in report["results"]["skipped_checks"]} <= ALLOWED_SKIPS


# ---------------------------------------------------------------------------- the containers' command lines


FIELD_VALUES = {"metadata.namespace": NAMESPACE, "status.podIP": "10.1.2.3"}


def container_env(docs: list[dict], workload: dict, container: dict) -> tuple[dict[str, str], set]:
    """The environment the kubelet gives ``container`` (pod 0 of ``workload``), and the (Secret, key)
    pairs it reads; Secret values are placeholders. $(VAR) expands as Kubernetes expands it: only
    variables defined before it, and an unknown reference stays as written."""
    configmaps = objects(docs, "ConfigMap")
    env: dict[str, str] = {}
    secrets: set[tuple[str, str]] = set()
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]]["data"])  # KeyError: no such ConfigMap
    pod_name = f"{workload['metadata']['name']}-0"
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                      lambda m: env.get(m[1], m[0]), var["value"])
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            secrets.add((ref["name"], ref["key"]))
            env[var["name"]] = f"secret-{ref['name']}-{ref['key']}"
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = pod_name if path == "metadata.name" else FIELD_VALUES[path]
    return env, secrets


def parsed(variant: str, name: str):
    docs = RENDERED[variant]
    workload, container = splitserve_containers(docs)[name]
    env, _ = container_env(docs, workload, container)
    return parse_container(container["args"], env, f"{variant}/{name}"), env


CONTAINERS = [(v, n) for v in VARIANTS for n in sorted(splitserve_containers(RENDERED[v]))]


@pytest.mark.parametrize("variant,name", CONTAINERS)
def test_container_args_and_environment_parse(variant, name):
    workload, container = splitserve_containers(RENDERED[variant])[name]
    # The image's ENTRYPOINT (`splitserve`) stays: the args are its subcommand, as compose's command.
    assert "command" not in container and container["args"][0] == name
    args, env = parsed(variant, name)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.port == ports["grpc"] and args.metrics_port == ports["metrics"]
    assert args.host == "0.0.0.0"  # reachable from other pods (and the kubelet's probes)
    if name == "gateway":
        assert args.http_port == ports["http"]
    else:
        # A worker registers its pod's stable name: <pod>.<headless Service>.<namespace>.svc.
        service = workload["spec"]["serviceName"]
        assert args.advertise_host == f"{name}-0.{service}.{NAMESPACE}.svc"
    if variant == "tls":
        mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "tls")
        assert {args.tls_cert, args.tls_key, args.tls_ca} == {f"{mount}/tls.crt", f"{mount}/tls.key", f"{mount}/ca.crt"}
    else:
        assert not (args.tls_cert or args.tls_key or args.tls_ca)


def test_parse_container_refuses_what_no_flag_reads():
    with pytest.raises(AssertionError, match="SPLITSERVE_DRAIN_TIMEOUT"):
        parse_container(["decode"], {"SPLITSERVE_DRAIN_TIMEOUT": "30"}, "typo")
    with pytest.raises(click.BadParameter, match="'soon' is not a valid float") as error:
        parse_container(["decode"], {"SPLITSERVE_DRAIN_TIMEOUT_S": "soon"}, "bad value")
    assert error.value.param.name == "drain_timeout_s"


# ---------------------------------------------------------------------------- what a user relies on


def probe_service(probe: dict) -> str:
    """The grpc.health.v1 service a probe asks: native gRPC, or the tls overlay's exec of the health script."""
    if "grpc" in probe:
        return probe["grpc"].get("service", "")
    argv = probe["exec"]["command"]
    assert argv[:2] == ["python", "/etc/splitserve/health/grpc_health.py"], argv
    return argv[2] if len(argv) > 2 else ""


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_ask_liveness_and_readiness(variant):
    containers = splitserve_containers(RENDERED[variant])
    assert set(containers) == {"gateway", "prefill", "decode"}
    for name, (_, container) in containers.items():
        args, _ = parsed(variant, name)
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container[kind]
            if "grpc" in probe:
                assert variant != "tls", "the kubelet's gRPC probe cannot speak TLS"
                assert probe["grpc"]["port"] == args.port
            else:
                assert variant == "tls" and probe["timeoutSeconds"] >= 5  # the script's own timeout is 4 s
            # Liveness (a restart acts on it) asks "", which stays SERVING while the process drains; the
            # gateway's readiness asks whether it can serve a request now; a worker's readiness
            # (Service endpoints only: gateways route by the Redis registry) asks the same as liveness.
            want = GENERATION if (name, kind) == ("gateway", "readinessProbe") else LIVENESS
            assert probe_service(probe) == want, (name, kind)


def test_tls_probes_run_composes_health_script():
    script = objects(RENDERED["tls"], "ConfigMap")["splitserve-health"]["data"]["grpc_health.py"]
    assert script == yaml.safe_load((ROOT / "compose.yaml").read_text())["x-grpc-health-script"]
    for name, (workload, container) in splitserve_containers(RENDERED["tls"]).items():
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert volumes["health"]["configMap"]["name"] == "splitserve-health"
        assert mounts["health"] == "/etc/splitserve/health"
        # The key is readable by the pod's group only, which the process is in.
        pod_security = workload["spec"]["template"]["spec"]["securityContext"]
        assert volumes["tls"]["secret"]["defaultMode"] == 0o440
        assert pod_security["fsGroup"] == pod_security["runAsGroup"]


def test_gateway_replicas_and_disruption_budget():
    docs = RENDERED["base"]
    gateway = objects(docs, "Deployment")["gateway"]
    replicas = gateway["spec"]["replicas"]
    assert replicas >= 2
    assert gateway["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    budgets = objects(docs, "PodDisruptionBudget")
    [budget] = [b for b in budgets.values() if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
    # It selects the gateway pods and nothing else, and lets a node drain proceed one pod at a time.
    for name, workload in workloads(docs).items():
        if name != "gateway":
            assert not budget["spec"]["selector"]["matchLabels"].items() <= \
                workload["spec"]["template"]["metadata"]["labels"].items(), name
    assert 1 <= budget["spec"]["minAvailable"] < replicas
    # Every selector in the manifests selects its own pods.
    for workload in workloads(docs).values():
        assert workload["spec"]["selector"]["matchLabels"].items() <= \
            workload["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("variant", VARIANTS)
def test_termination_grace_outlasts_the_drain(variant):
    # The flag's own default, and the value each container runs with (config.yaml may set it).
    default = BY_NAME["drain_timeout_s"].default
    assert default > 0
    for name, (workload, _) in splitserve_containers(RENDERED[variant]).items():
        args, _ = parsed(variant, name)
        grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > max(args.drain_timeout_s, default) + 5, name


def test_workers_ask_for_gpus_and_the_gateway_for_none():
    docs = RENDERED["base"]
    for name, (workload, container) in splitserve_containers(docs).items():
        resources = container["resources"]
        if name == "gateway":
            assert "nvidia.com/gpu" not in resources["requests"] | resources["limits"]
            assert container["image"] == "splitserve:cpu"
            continue
        assert container["image"] == "splitserve:cuda"
        gpus = resources["limits"]["nvidia.com/gpu"]
        assert gpus >= 1 and resources["requests"]["nvidia.com/gpu"] == gpus
        args, _ = parsed("base", name)
        assert args.device == "cuda:0"  # the pod sees only the GPUs it was given
        # Separate pods share no IPC namespace: neither cuda_ipc nor shm can work between them.
        transports = args.kv_transport.split(",")
        assert transports and not {"cuda_ipc", "shm"} & set(transports), name
        tolerations = workload["spec"]["template"]["spec"]["tolerations"]
        assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)


def test_services_reach_the_pods():
    docs = RENDERED["base"]
    services = objects(docs, "Service")
    for name, workload in workloads(docs).items():
        service = services[name]
        template = workload["spec"]["template"]
        assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]], (name, port)
        if workload["kind"] == "StatefulSet":
            assert workload["spec"]["serviceName"] == name
        if name in ("prefill", "decode"):
            # Headless: the per-pod DNS names the workers register; they resolve before readiness.
            assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    # SPLITSERVE_REDIS_URL names the redis Service.
    args, _ = parsed("base", "gateway")
    url = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", args.redis_url)
    assert url and url[1] in services and int(url[2]) in {p["port"] for p in services[url[1]]["spec"]["ports"]}


def test_redis_persists_its_append_only_file():
    redis = objects(RENDERED["base"], "StatefulSet")["redis"]
    [container] = redis["spec"]["template"]["spec"]["containers"]
    argv = container["command"]
    assert argv[0] == "redis-server" and argv[argv.index("--appendonly") + 1] == "yes"
    [claim] = redis["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert argv[argv.index("--dir") + 1] == mounts[claim["metadata"]["name"]]
    assert claim["spec"]["resources"]["requests"]["storage"]
    assert argv[argv.index("--requirepass") + 1] == "$(SPLITSERVE_REDIS_PASSWORD)"
    env, secrets = container_env(RENDERED["base"], redis, container)
    assert ("splitserve-redis", "password") in secrets
    # The Service is not exposed outside the cluster.
    assert objects(RENDERED["base"], "Service")["redis"]["spec"]["type"] == "ClusterIP"


@pytest.mark.parametrize("variant", VARIANTS)
def test_containers_run_unprivileged(variant):
    for name, workload in workloads(RENDERED[variant]).items():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] >= 10000
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
            assert security["capabilities"]["drop"] == ["ALL"]
            assert container["resources"]["limits"]["memory"] and container["resources"]["limits"]["cpu"]


# ---------------------------------------------------------------------------- docs/deploy.md


def kubernetes_section() -> str:
    text = (ROOT / "docs" / "deploy.md").read_text()
    start = text.index("\n## Kubernetes")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def documented_secrets() -> dict[str, set[str]]:
    """Secret name -> keys, from the `kubectl create secret generic` commands of docs/deploy.md."""
    secrets: dict[str, set[str]] = {}
    for block in re.findall(r"```sh\n(.*?)```", kubernetes_section(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv[:1] == ["kubectl"] and "create" in argv and "secret" in argv:
                assert argv[argv.index("secret") + 1] == "generic" and argv[argv.index("-n") + 1] == NAMESPACE, line
                name = argv[argv.index("generic") + 1]
                keys = {a.split("=", 1)[1].split("=", 1)[0] for a in argv if a.startswith(("--from-literal=", "--from-file="))}
                secrets[name] = keys
    return secrets


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_secret_used_is_created_by_the_docs(variant):
    docs = RENDERED[variant]
    documented = documented_secrets()
    defined = {name: set(s.get("data", {})) | set(s.get("stringData", {})) for name, s in objects(docs, "Secret").items()}
    available = {**documented, **defined}
    used: set[tuple[str, str]] = set()
    for workload in workloads(docs).values():
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            used |= container_env(docs, workload, container)[1]
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                keys = {i["key"] for i in volume["secret"].get("items", [])} or available.get(volume["secret"]["secretName"], set())
                used |= {(volume["secret"]["secretName"], k) for k in keys}
                assert volume["secret"]["secretName"] in available, volume
            if "configMap" in volume:
                assert volume["configMap"]["name"] in objects(docs, "ConfigMap"), volume
    for name, key in sorted(used):
        assert key in available.get(name, set()), f"Secret {name} key {key}: neither in the manifests nor in docs/deploy.md"
    if variant == "tls":
        mount_files = {"tls.crt", "tls.key", "ca.crt"}
        assert mount_files <= documented["splitserve-tls"]


def test_deploy_doc_kubernetes_section_names_the_manifests():
    section = kubernetes_section()
    for needed in ("kubectl apply -k deploy/kubernetes/base", "kubectl apply -k deploy/kubernetes/tls",
                   "nvidia.com/gpu", "kubectl -n splitserve scale", "rollout status"):
        assert needed in section, needed


# ---------------------------------------------------------------------------- autoscaling

ADAPTER_VALUES = ROOT / "deploy" / "prometheus" / "adapter-values.yaml"


def exported_metric_names() -> set[str]:
    """Every Prometheus metric name splitserve's processes declare (histograms and counters by
    their family name; a histogram's series add _bucket, a counter's _total)."""
    text = (ROOT / "splitserve" / "common" / "metrics.py").read_text()
    return set(re.findall(r'(?:Counter|Gauge|Histogram)\(\s*"([^"]+)"', text))


def test_autoscalers_scale_each_phase_on_metrics_the_adapter_makes_from_ours():
    docs = RENDERED["autoscaling"]
    scalers = objects(docs, "HorizontalPodAutoscaler")
    assert set(scalers) == {"prefill", "decode"}
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]
    made = {"Pods": {r["name"]["as"]: r for r in rules["custom"]},
            "External": {r["name"]["as"]: r for r in rules["external"]}}
    exported = exported_metric_names()
    for name, scaler in scalers.items():
        spec = scaler["spec"]
        target = spec["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("StatefulSet", name)
        assert name in objects(docs, "StatefulSet")
        assert 1 <= spec["minReplicas"] < spec["maxReplicas"]
        for metric in spec["metrics"]:
            kind = metric["type"]
            metric_name = metric[kind.lower()]["metric"]["name"]
            rule = made[kind][metric_name]  # the adapter serves every metric an autoscaler reads
            series = rule["name"]["matches"]
            family = re.sub(r"_bucket$", "", series)
            assert family in exported, f"{metric_name}: {series} is no series splitserve exports"
            if kind == "Pods":  # a worker's own series, of its own role
                assert f'pod=~"{name}-.*"' in rule["metricsQuery"], metric_name
        # Hysteresis and a bounded rate: down waits longer than up, one pod per period each way.
        behavior = spec["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] > behavior["scaleUp"]["stabilizationWindowSeconds"]
        for direction in ("scaleUp", "scaleDown"):
            assert all(p["type"] == "Pods" and p["value"] == 1 for p in behavior[direction]["policies"])
    # The workers drain on scale-down: their grace outlasts the drain (test_termination_grace_outlasts_the_drain).
    assert {"prefill", "decode"} <= set(workloads(docs))
