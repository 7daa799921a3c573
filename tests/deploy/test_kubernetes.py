"""deploy/kubernetes: every manifest of the base and its overlays, rendered as `kustomize build` renders them
(tests/deploy/kustomize.py; checked against `kubectl kustomize` where kubectl is installed), is valid for Kubernetes
(kubernetes-validate's bundled schemas, strict) and lint-clean (yamllint, deploy/kubernetes/.yamllint); runs the
commands `tandem up` runs for each role, parsed by the roles' own argparse parsers; and agrees with itself: ports,
Services, probes, grace periods, GPUs, disruption budgets, secrets. The Prometheus operator's objects (CRDs, beyond
kubernetes-validate) are checked by structure, their rules by promtool."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml
from yamllint import config as yamllint_config, linter

import cli.up
import decode_svc.server
import prefill_svc.server
import router.server
from serving.auth import ENV_API_KEY

import kustomize  # tests/deploy/kustomize.py (pytest puts a test's directory on the path, as for scripted_backend)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
TLS_DIR = "/etc/tandem/tls/"
# target -> the `tandem up` invocation whose commands its containers run (as compose.yaml's x-tandem-up).
TARGETS = {
    "base": ["--host", "0.0.0.0", "--device", "cuda"],
    "overlays/cpu": ["--host", "0.0.0.0", "--device", "cpu"],
    "overlays/tls": ["--host", "0.0.0.0", "--device", "cuda", "--tls-cert", TLS_DIR + "tls.crt",
                     "--tls-key", TLS_DIR + "tls.key", "--tls-ca", TLS_DIR + "ca.crt"],
}
# `tandem up`'s process -> the host the others reach it by: its headless Service's name (one address per pod).
HOSTS = {"prefill-0": "tandem-prefill", "decode-0": "tandem-decode"}
WORKLOADS = {"router": ("Deployment", "tandem-router"), "prefill-0": ("StatefulSet", "tandem-prefill"),
             "decode-0": ("StatefulSet", "tandem-decode")}
PARSERS = {"router": router.server.build_parser, "prefill": prefill_svc.server.build_parser,
           "decode": decode_svc.server.build_parser}
# Flags `tandem up` passes that the manifests leave off on purpose, by process: the prefill's decode allowlist
# matches literal addresses, and a pod's address is not known when the manifest is written (deploy/kubernetes/
# base/prefill.yaml says more).
LEFT_OFF = {"prefill-0": {"--decode-allowlist"}}
# Kubernetes versions to validate against: the oldest still common and the newest bundled.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request) -> tuple[str, list[dict]]:
    return request.param, kustomize.build(DEPLOY / request.param)


def _obj(objects: list[dict], kind: str, name: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _container(objects: list[dict], process: str) -> dict:
    (container,) = _obj(objects, *WORKLOADS[process])["spec"]["template"]["spec"]["containers"]
    return container


def _parse(cmd: list[str]):
    """The namespace of a `tandem <role> ...` command line, by that role's own parser; every flag spelt in full."""
    assert cmd[0] == "tandem" and cmd[1] in PARSERS, cmd
    parser = PARSERS[cmd[1]]()
    known = {s for action in parser._actions for s in action.option_strings}
    for token in cmd[2:]:
        if token.startswith("--"):
            assert token.split("=")[0] in known, f"{token}: not a flag of tandem {cmd[1]} (argparse would take a " \
                                                 "prefix of one)"
    try:
        return parser.parse_args(cmd[2:])
    except SystemExit:
        pytest.fail(f"tandem {cmd[1]} refuses its arguments: {cmd}")


def _command(container: dict) -> list[str]:
    return container.get("command", []) + container.get("args", [])


# id(objects) -> (objects, their namespaces): the rendering is kept, so its id is never another's.
_NAMESPACES: dict[int, tuple[list, dict]] = {}


def _namespaces(objects: list[dict]) -> dict:
    """process -> its container's parsed command line (parsed once per rendering)."""
    if id(objects) not in _NAMESPACES:
        _NAMESPACES[id(objects)] = objects, {p: _parse(_command(_container(objects, p))) for p in WORKLOADS}
    return _NAMESPACES[id(objects)][1]


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _pod_labels(objects: list[dict], process: str) -> dict:
    return _obj(objects, *WORKLOADS[process])["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------------------------------------------- files
def _yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml") or p.name == ".yamllint")


def test_yamllint_passes_on_every_file():
    conf = yamllint_config.YamlLintConfig(file=str(DEPLOY / ".yamllint"))
    problems = [f"{path.relative_to(ROOT)}:{p.line}:{p.column}: {p.message} ({p.rule})"
                for path in _yaml_files() for p in linter.run(path.read_text(), conf, str(path))]
    assert not problems, "\n".join(problems)


def test_every_kubernetes_object_is_valid_in_strict_mode(target):
    name, objects = target
    for version in K8S_VERSIONS:
        for obj in objects:
            if obj["kind"] in OPERATOR_KINDS:
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.utils.ValidationError as e:
                pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} on Kubernetes {version}: {e.message} "
                            f"at {'/'.join(map(str, e.path))}")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: the renderer is unchecked")
@pytest.mark.parametrize("name", [*TARGETS, "monitoring"])
def test_the_renderer_agrees_with_kubectl_kustomize(name):
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / name)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    theirs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out.stdout) if o}
    ours = {(o["kind"], o["metadata"]["name"]): o for o in kustomize.build(DEPLOY / name)}
    assert ours == theirs


def test_the_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("apiVersion: kustomize.config.k8s.io/v1beta1\n"
                                                 "kind: Kustomization\nnamePrefix: x-\n")
    with pytest.raises(ValueError, match="namePrefix"):
        kustomize.build(tmp_path)
    with pytest.raises(ValueError, match="test /a/0"):
        kustomize.apply_json_patch({"a": ["--device"]}, [{"op": "test", "path": "/a/0", "value": "--model"}])


# ---------------------------------------------------------------------------------------------------- commands
def test_containers_run_the_commands_tandem_up_runs(target):
    name, objects = target
    ns = cli.up.build_parser().parse_args(TARGETS[name])
    expected = cli.up.launch_commands(ns, address=lambda process: HOSTS[process])
    assert set(expected) == set(WORKLOADS)
    for process, cmd in expected.items():
        for flag in LEFT_OFF.get(process, ()):
            at = cmd.index(flag)  # (launch_commands does pass it)
            cmd = cmd[:at] + cmd[at + 2:]
        assert vars(_parse(_command(_container(objects, process)))) == vars(_parse(cmd)), (name, process)


def test_the_router_names_each_workers_headless_service_and_port(target):
    _, objects = target
    ns = _namespaces(objects)
    for role, flag_value in (("prefill", ns["router"].prefill), ("decode", ns["router"].decode)):
        (address,) = flag_value.split(",")  # one name for all the pods of the role
        host, _, port = address.rpartition(":")
        kind, workload = WORKLOADS[f"{role}-0"]
        sts = _obj(objects, kind, workload)
        assert sts["spec"]["serviceName"] == host
        svc = _obj(objects, "Service", host)
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        assert _selects(svc["spec"]["selector"], _pod_labels(objects, f"{role}-0"))
        # A headless Service maps no port: peers dial the pod's own port, which must be the one named.
        assert int(port) == ns[f"{role}-0"].port == _ports(_container(objects, f"{role}-0"))["grpc"]


def test_container_ports_are_the_ports_in_the_args_and_services_target_them(target):
    _, objects = target
    ns = _namespaces(objects)
    assert _ports(_container(objects, "router")) == {"http": ns["router"].http_port, "grpc": ns["router"].grpc_port}
    for process in ("prefill-0", "decode-0"):
        assert _ports(_container(objects, process)) == {"grpc": ns[process].port, "metrics": ns[process].metrics_port}
    services = [o for o in objects if o["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} == {"tandem-router", "tandem-prefill", "tandem-decode"}
    for svc in services:
        (process,) = [p for p in WORKLOADS if _selects(svc["spec"]["selector"], _pod_labels(objects, p))]
        ports = _ports(_container(objects, process))
        for port in svc["spec"]["ports"]:
            target_port = port["targetPort"]
            number = ports[target_port] if isinstance(target_port, str) else target_port
            assert number in ports.values() and port["port"] == number, (svc["metadata"]["name"], port)
            assert port["name"] in ports


def _router_get_paths() -> set[str]:
    from router.http import create_app

    app = create_app(types.SimpleNamespace(tokenizer=None))  # (only to read the routes; nothing is served)
    return {route.path for route in app.routes if "GET" in getattr(route, "methods", ())}


def test_probes_point_at_ports_and_paths_that_exist(target):
    name, objects = target
    ns = _namespaces(objects)
    router = _container(objects, "router")
    gets = _router_get_paths()
    probes = {kind: router[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    for probe in probes.values():
        assert probe["port"] in _ports(router) and probe["path"] in gets
        assert probe.get("scheme", "HTTP") == ("HTTPS" if ns["router"].tls_cert else "HTTP")
    # Readiness is /health (503 without instances); liveness must not depend on them.
    assert probes["readinessProbe"]["path"] == "/health"
    assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/livez"
    for process in ("prefill-0", "decode-0"):
        container = _container(objects, process)
        commands = set()
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]
            if ns[process].tls_cert is None:
                assert probe["grpc"] == {"port": ns[process].port}, (name, process, kind)
            else:  # the kubelet's gRPC probe presents no client certificate: a mutual-TLS worker refuses it
                assert "grpc" not in probe
                code = probe["exec"]["command"]
                assert code[:2] == ["python", "-c"]
                assert re.findall(r"localhost:(\d+)", code[2]) == [str(ns[process].port)]
                commands.add(tuple(code))
        assert len(commands) <= 1, "one check for startup, readiness and liveness"


def _pre_stop_s(container: dict) -> float:
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    assert hook["exec"]["command"][0] == "sleep", hook
    return float(hook["exec"]["command"][1])


def test_termination_grace_covers_the_drains(target):
    _, objects = target
    ns = _namespaces(objects)
    for process, (kind, workload) in WORKLOADS.items():
        spec = _obj(objects, kind, workload)["spec"]["template"]["spec"]
        container = _container(objects, process)
        # SIGTERM comes after preStop; then the drain (--shutdown-grace), the servers' close, the process's exit
        # (tandem up gives a child the same margin before SIGKILL).
        need = _pre_stop_s(container) + ns[process].shutdown_grace + cli.up._STOP_MARGIN_S
        if process == "router":
            need += router.server._CLOSE_MARGIN_S
        assert spec["terminationGracePeriodSeconds"] > need, (process, spec["terminationGracePeriodSeconds"], need)


def test_workers_get_one_gpu_each_unless_on_the_cpu(target):
    name, objects = target
    ns = _namespaces(objects)
    assert "nvidia.com/gpu" not in json.dumps(_obj(objects, *WORKLOADS["router"]))
    for process in ("prefill-0", "decode-0"):
        limits = _container(objects, process)["resources"].get("limits", {})
        if ns[process].device == "cpu":
            assert name == "overlays/cpu"
            assert "nvidia.com/gpu" not in json.dumps(_obj(objects, *WORKLOADS[process]))
        else:
            assert ns[process].device == "cuda" and limits["nvidia.com/gpu"] == 1


def test_every_workload_has_a_disruption_budget_of_one_pod(target):
    _, objects = target
    pdbs = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    for process in WORKLOADS:
        (pdb,) = [p for p in pdbs if _selects(p["spec"]["selector"]["matchLabels"], _pod_labels(objects, process))]
        assert pdb["spec"]["maxUnavailable"] == 1
        assert _obj(objects, *WORKLOADS[process])["spec"]["selector"]["matchLabels"] == pdb["spec"]["selector"][
            "matchLabels"]


def test_models_are_cached_on_a_volume_at_tandem_cache_dir(target):
    _, objects = target
    for process, (kind, workload) in WORKLOADS.items():
        container = _container(objects, process)
        env = {e["name"]: e.get("value") for e in container["env"]}
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == env["TANDEM_CACHE_DIR"]]
        obj = _obj(objects, kind, workload)
        if kind == "StatefulSet":  # one volume per pod, kept across its restarts
            assert [t["metadata"]["name"] for t in obj["spec"]["volumeClaimTemplates"]] == [mount["name"]]
        else:
            assert mount["name"] in {v["name"] for v in obj["spec"]["template"]["spec"]["volumes"]}


def test_tls_flags_name_files_of_the_mounted_secret_and_the_key_is_required(target):
    name, objects = target
    ns = _namespaces(objects)
    env = {e["name"]: e for e in _container(objects, "router")["env"]}
    ref = env[ENV_API_KEY]["valueFrom"]["secretKeyRef"]
    assert ref["optional"] is (name != "overlays/tls")  # required with TLS, as compose.tls.yaml
    for process, (kind, workload) in WORKLOADS.items():
        container = _container(objects, process)
        if ns[process].tls_cert is None:
            assert "tls" not in {m["name"] for m in container["volumeMounts"]}
            continue
        volumes = {v["name"]: v for v in _obj(objects, kind, workload)["spec"]["template"]["spec"]["volumes"]}
        for path in (ns[process].tls_cert, ns[process].tls_key, ns[process].tls_ca):
            directory, _, file = path.rpartition("/")
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
            assert mount["readOnly"] is True
            assert volumes[mount["name"]]["secret"]["secretName"] == "tandem-tls"
            assert file in ("tls.crt", "tls.key", "ca.crt")  # a kubernetes.io/tls Secret's keys, with its CA


# ---------------------------------------------------------------------------------------------------- live checks
def _certs(directory: Path) -> Path:
    """scripts/make-certs into directory, the files renamed as the tandem-tls Secret's keys."""
    subprocess.run(["bash", str(ROOT / "scripts" / "make-certs"), str(directory)], check=True, capture_output=True)
    for made, key in (("tandem.crt", "tls.crt"), ("tandem.key", "tls.key"), ("ca.crt", "ca.crt")):
        (directory / key).write_bytes((directory / made).read_bytes())
    return directory


def _health_server(certs: Path | None) -> tuple[grpc.Server, int]:
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # "" is SERVING
    if certs is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        creds = grpc.ssl_server_credentials([((certs / "tls.key").read_bytes(), (certs / "tls.crt").read_bytes())],
                                            root_certificates=(certs / "ca.crt").read_bytes(),
                                            require_client_auth=True)
        port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    return server, port


@pytest.mark.slow
@pytest.mark.parametrize("process", ["prefill-0", "decode-0"])
def test_tls_worker_probes_speak_mutual_tls(tmp_path, process):
    objects = kustomize.build(DEPLOY / "overlays/tls")
    container = _container(objects, process)
    code = container["readinessProbe"]["exec"]["command"][2]
    own = re.findall(r"localhost:(\d+)", code)[0]
    certs, foreign = _certs(tmp_path / "ours"), _certs(tmp_path / "theirs")
    servers = {"right": _health_server(certs), "foreign": _health_server(foreign), "plain": _health_server(None)}
    try:
        codes = {}
        for which, (_, port) in servers.items():
            run = code.replace(f"localhost:{own}", f"localhost:{port}").replace(TLS_DIR, f"{certs}/")
            codes[which] = subprocess.run([sys.executable, "-c", run], capture_output=True, timeout=60).returncode
        assert codes["right"] == 0 and codes["foreign"] != 0 and codes["plain"] != 0, codes
    finally:
        for server, _ in servers.values():
            server.stop(None)


# ---------------------------------------------------------------------------------------------------- monitoring
_SERVICE_MONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False, "properties": {
            "selector": {"type": "object", "required": ["matchLabels"], "properties": {
                "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["port"], "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                    "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                    "scheme": {"enum": ["http", "https"]}}}}}}}}
_PROMETHEUS_RULE = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"},
        "spec": {"type": "object", "required": ["groups"], "additionalProperties": False, "properties": {
            "groups": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["name", "rules"], "properties": {"rules": {"type": "array", "items": {
                    "type": "object", "required": ["alert", "expr", "for", "labels", "annotations"]}}}}}}}}}


@pytest.fixture(scope="module")
def monitoring() -> dict[str, dict]:
    return {o["kind"]: o for o in kustomize.build(DEPLOY / "monitoring")}


def test_the_service_monitor_scrapes_every_service_on_a_metrics_port(monitoring):
    monitor = monitoring["ServiceMonitor"]
    jsonschema.validate(monitor, _SERVICE_MONITOR)
    objects = kustomize.build(DEPLOY / "base")
    ns = _namespaces(objects)
    scraped = {e["port"]: e.get("path", "/metrics") for e in monitor["spec"]["endpoints"]}
    for svc in (o for o in objects if o["kind"] == "Service"):
        assert _selects(monitor["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
        (process,) = [p for p in WORKLOADS if _selects(svc["spec"]["selector"], _pod_labels(objects, p))]
        names = {p["name"] for p in svc["spec"]["ports"]} & set(scraped)
        # The router's /metrics is on its HTTP port; a worker's on --metrics-port.
        expected = {"http"} if process == "router" else {"metrics"}
        assert names == expected, (svc["metadata"]["name"], names)
        if process != "router":
            assert ns[process].metrics_port == _ports(_container(objects, process))["metrics"] > 0
        assert scraped[names.pop()] == "/metrics"
    assert "/metrics" in _router_get_paths()


def _registered_metrics() -> set[str]:
    """Every series name Tandem exports (families are created per role on first use: their declarations count)."""
    import kv_transfer.metrics  # noqa: F401 - each module declares or registers its metrics on import
    import router.admission  # noqa: F401
    import router.http  # noqa: F401
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    from serving.metrics import DECLARED

    suffixes = {Counter: ("_total",), Gauge: ("",), Histogram: ("_bucket", "_count", "_sum")}
    return set(REGISTRY._names_to_collectors) | {f"tandem:{f.name}{s}" for f in DECLARED for s in suffixes[f.kind]}


def test_the_alert_rules_pass_promtool_and_name_metrics_that_exist(monitoring, tmp_path):
    rule = monitoring["PrometheusRule"]
    jsonschema.validate(rule, _PROMETHEUS_RULE)
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    names = {m for e in exprs for m in re.findall(r"tandem:[a-z_:]+", e)}
    registered = _registered_metrics()
    for name in names:
        assert name in registered or re.sub(r"_(bucket|count|sum)$", "", name) in registered, name
    # `up` by job: the ServiceMonitor's jobs are the Services' names.
    services = {o["metadata"]["name"] for o in kustomize.build(DEPLOY / "base") if o["kind"] == "Service"}
    (jobs,) = {m for e in exprs for m in re.findall(r'up\{job=~"tandem-\(([a-z|]+)\)"\}', e)}
    assert {f"tandem-{j}" for j in jobs.split("|")} == services
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: prometheus)")
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# Synthetic series (one sample a minute) under which each alert fires, for the labels given, and the neighbours that
# must not: another job down, a decode pod's waiting requests (not the routers' queue), a KV cache at half.
_SERIES = [
    ('up{job="tandem-decode", namespace="a", pod="tandem-decode-1", instance="10.0.0.7:9101"}', "0x20"),
    ('up{job="node-exporter", namespace="a", pod="x", instance="10.0.0.8:9100"}', "0x20"),
    ('tandem:time_to_first_token_seconds_bucket{role="router", namespace="a", pod="r", le="1"}', "0+0x20"),
    ('tandem:time_to_first_token_seconds_bucket{role="router", namespace="a", pod="r", le="2.5"}', "0+10x20"),
    ('tandem:time_to_first_token_seconds_bucket{role="router", namespace="a", pod="r", le="+Inf"}', "0+10x20"),
    ('tandem:num_requests_waiting{role="router", namespace="a", pod="r"}', "150x20"),
    ('tandem:num_requests_waiting{role="decode", namespace="b", pod="d"}', "500x20"),
    ('tandem:kv_cache_usage_perc{role="decode", namespace="a", pod="tandem-decode-0"}', "0.9x20"),
    ('tandem:kv_cache_usage_perc{role="decode", namespace="a", pod="tandem-decode-1"}', "0.5x20"),
    ('tandem:kv_transfer_failures_total{role="prefill", namespace="a", pod="tandem-prefill-0"}', "0+1x20"),
    ('tandem:router_instances{role="router", namespace="a", pod="r", instance_role="decode", state="mismatched"}',
     "1x20"),
    ('tandem:router_instances{role="router", namespace="a", pod="r", instance_role="decode", state="healthy"}', "3x20"),
]
_FIRING = {  # alert -> the labels it fires with at 18 min, and its summary then
    "TandemInstanceDown": ({"job": "tandem-decode", "namespace": "a", "pod": "tandem-decode-1",
                            "instance": "10.0.0.7:9101"}, "tandem-decode pod tandem-decode-1 is not answering scrapes"),
    # (between the 1 s and 2.5 s buckets, all of it: p95 = 1 + 0.95 x 1.5)
    "TandemHighTimeToFirstToken": ({"namespace": "a"}, "TTFT p95 is 2.425s in a"),
    "TandemQueueBacklog": ({"namespace": "a"}, "150 requests queued in the routers of a"),
    "TandemKvCacheNearlyFull": ({"namespace": "a", "pod": "tandem-decode-0"}, "KV cache of tandem-decode-0 is 90% full"),
    "TandemKvTransferFailures": ({"namespace": "a", "pod": "tandem-prefill-0"},
                                 "KV transfers failing on tandem-prefill-0"),
    "TandemInstanceMismatched": ({"namespace": "a", "pod": "r", "instance_role": "decode"},
                                 "router r routes nothing to 1 mismatched decode worker(s)"),
}


def _labels_in(template: str, labels: dict) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], template)


def test_each_alert_fires_on_its_condition_and_not_on_its_neighbours(monitoring, tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: prometheus)")
    groups = monitoring["PrometheusRule"]["spec"]["groups"]
    rules = {r["alert"]: r for g in groups for r in g["rules"]}
    assert set(rules) == set(_FIRING)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": groups}))
    alerts = [{"eval_time": "18m", "alertname": name, "exp_alerts": [{
        "exp_labels": {**labels, **rules[name]["labels"]},
        "exp_annotations": {"summary": summary,
                            "description": _labels_in(rules[name]["annotations"]["description"], labels)}}]}
        for name, (labels, summary) in _FIRING.items()]
    # Before their `for:` has passed, none fires.
    alerts += [{"eval_time": "1m", "alertname": name, "exp_alerts": []} for name in _FIRING]
    tests = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": [{"series": s, "values": v} for s, v in _SERIES],
        "alert_rule_test": alerts}]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    out = subprocess.run([promtool, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
