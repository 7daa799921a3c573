"""compose.tls.yaml, merged over compose.yaml as `docker compose -f compose.yaml -f compose.tls.yaml` does: a valid
Compose file whose commands are `tandem up`'s with the TLS flags, whose secrets are what scripts/make-certs writes,
and whose health checks pass against real TLS servers holding those certificates (and fail against a plaintext
server or one whose certificate another CA signed)."""
from __future__ import annotations

import http.server
import json
import re
import socket
import ssl
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import jsonschema
import pytest
import yaml
from grpc_health.v1 import health, health_pb2_grpc

from cli.up import build_parser, launch_commands
from serving.tls import TlsConfig

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT.parent / "shared" / "schemas" / "compose-spec.json"
SECRETS = "/run/secrets/"
# Compose replaces these sequences when a later file sets them; it merges other mappings key by key, a service's
# volumes by their target path and its secrets as a union.
_REPLACED = {("command",), ("entrypoint",), ("healthcheck", "test")}


def _merge(base, over, path: tuple = ()):
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(base[k], v, path + (k,)) if k in base else v
        return out
    if isinstance(base, list) and isinstance(over, list) and path[-1:] not in {p[-1:] for p in _REPLACED}:
        if path[-1:] == ("volumes",):
            by_target = {v.split(":")[1]: v for v in base} | {v.split(":")[1]: v for v in over}
            return list(by_target.values())
        return base + [v for v in over if v not in base]
    return over


@pytest.fixture(scope="module")
def override() -> dict:
    return yaml.safe_load((ROOT / "compose.tls.yaml").read_text())


@pytest.fixture(scope="module")
def merged(override) -> dict:
    return _merge(yaml.safe_load((ROOT / "compose.yaml").read_text()), override)


def _tandem(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items() if "profiles" not in svc}


def test_merged_file_matches_the_schema(merged, override):
    if not SCHEMA.exists():
        pytest.skip(f"{SCHEMA} is missing (the shared schemas sit beside the checkout)")
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    validator.validate(merged)
    validator.validate(override)  # (compose validates each file on its own too)


def test_services_run_the_launchers_commands_with_tls(merged, override):
    ns = build_parser().parse_args(override["x-tandem-up"])
    assert ns.tls_cert and ns.tls_key and ns.tls_ca
    expected = launch_commands(ns, address=lambda name: name)
    assert {name: svc["command"] for name, svc in _tandem(merged).items()} == expected


def test_every_tls_path_is_a_secret_the_service_mounts(merged):
    secrets = merged["secrets"]
    for name, svc in _tandem(merged).items():
        cmd = svc["command"]
        for flag in ("--tls-cert", "--tls-key", "--tls-ca"):
            path = cmd[cmd.index(flag) + 1]
            assert path.startswith(SECRETS), (name, flag, path)
            assert path.removeprefix(SECRETS) in svc["secrets"], (name, path)
        for ref in re.findall(r"/run/secrets/([\w-]*)", " ".join(svc["healthcheck"]["test"])):
            # ("tandem-" + n in a worker's check: each of the three)
            assert any(secret.startswith(ref) for secret in svc["secrets"]), (name, ref)
    # Every secret's file is one scripts/make-certs writes.
    assert {Path(s["file"]).name for s in secrets.values()} == {"tandem.crt", "tandem.key", "ca.crt"}
    assert merged["services"]["router"]["environment"]["TANDEM_API_KEY"].startswith("${TANDEM_API_KEY:?")


def test_the_image_never_holds_the_keys():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "certs" in ignored


# ---------------------------------------------------------------------------------------------------- live checks
def _make_certs(directory: Path) -> Path:
    """scripts/make-certs into directory, and directory/secrets/: the files under the names of compose's secrets."""
    subprocess.run(["bash", str(ROOT / "scripts" / "make-certs"), str(directory)], check=True, capture_output=True)
    secrets = yaml.safe_load((ROOT / "compose.tls.yaml").read_text())["secrets"]
    (directory / "secrets").mkdir()
    for name, secret in secrets.items():
        (directory / "secrets" / name).write_bytes((directory / Path(secret["file"]).name).read_bytes())
    return directory


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    return _make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def foreign_certs(tmp_path_factory) -> Path:
    return _make_certs(tmp_path_factory.mktemp("foreign"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_check(svc: dict, port: int, certs: Path) -> int:
    """The service's health check, as its container would run it, against 127.0.0.1:port, with the files of
    `certs` where the container has its secrets."""
    kind, python, flag, code = svc["healthcheck"]["test"]
    assert (kind, python, flag) == ("CMD", "python", "-c")
    cmd = svc["command"]
    own = cmd[cmd.index("--port" if "--port" in cmd else "--http-port") + 1]
    assert re.findall(r"localhost:(\d+)", code) == [own], "the check dials its own service's port"
    code = code.replace(f"localhost:{own}", f"localhost:{port}")
    code = code.replace(SECRETS, f"{certs / 'secrets'}/")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode


def _grpc_health_server(tls: TlsConfig | None) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # "" is SERVING
    port = _free_port()
    if tls is None:
        server.add_insecure_port(f"127.0.0.1:{port}")
    else:
        server.add_secure_port(f"127.0.0.1:{port}", tls.server_credentials(require_client_auth=True))
    server.start()
    return server, port


def _tls(certs: Path) -> TlsConfig:
    return TlsConfig(str(certs / "tandem.crt"), str(certs / "tandem.key"), str(certs / "ca.crt"))


@pytest.mark.parametrize("name", ["prefill-0", "decode-0", "decode-1"])
def test_worker_health_checks_speak_mutual_tls(merged, certs, foreign_certs, name):
    svc = merged["services"][name]
    right, right_port = _grpc_health_server(_tls(certs))
    foreign, foreign_port = _grpc_health_server(_tls(foreign_certs))
    plain, plain_port = _grpc_health_server(None)
    try:
        assert _run_check(svc, right_port, certs) == 0
        assert _run_check(svc, foreign_port, certs) != 0  # its certificate: another CA
        assert _run_check(svc, plain_port, certs) != 0
    finally:
        for s in (right, foreign, plain):
            s.stop(None)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _https_server(certs: Path) -> tuple[http.server.HTTPServer, int]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs / "tandem.crt", certs / "tandem.key")
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def test_router_health_check_speaks_https(merged, certs, foreign_certs):
    svc = merged["services"]["router"]
    right, right_port = _https_server(certs)
    foreign, foreign_port = _https_server(foreign_certs)
    try:
        assert _run_check(svc, right_port, certs) == 0
        assert _run_check(svc, foreign_port, certs) != 0
    finally:
        right.shutdown()
        foreign.shutdown()


def test_certificate_names_every_host_peers_dial(merged, certs):
    """Each address a command dials (and localhost, which the health checks dial) is in the certificate."""
    dialled = {"localhost"}
    for svc in _tandem(merged).values():
        cmd = svc["command"]
        for flag in ("--prefill", "--decode", "--decode-allowlist"):
            if flag in cmd:
                dialled |= {a.rsplit(":", 1)[0] for a in cmd[cmd.index(flag) + 1].split(",")}
    dialled.add("router")  # Prometheus scrapes router:8000 over HTTPS
    ctx = ssl.create_default_context(cafile=certs / "ca.crt")
    server, port = _https_server(certs)
    try:
        for host in sorted(dialled):
            with socket.create_connection(("127.0.0.1", port)) as raw, ctx.wrap_socket(raw, server_hostname=host):
                pass  # (the handshake checked the name)
    finally:
        server.shutdown()


def test_prometheus_scrapes_the_router_over_https(merged):
    from test_monitoring import metrics_targets, scrape_targets

    prometheus = merged["services"]["prometheus"]
    (config,) = [v.split(":")[0] for v in prometheus["volumes"] if v.split(":")[1] == "/etc/prometheus/prometheus.yml"]
    path = ROOT / config
    commands = {name: svc["command"] for name, svc in _tandem(merged).items()}
    assert scrape_targets(path) == metrics_targets(commands, lambda name: name)
    (router,) = [job for job in yaml.safe_load(path.read_text())["scrape_configs"] if job["job_name"] == "tandem-router"]
    assert router["scheme"] == "https"
    assert router["tls_config"]["ca_file"].removeprefix(SECRETS) in prometheus["secrets"]
