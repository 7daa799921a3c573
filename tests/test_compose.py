"""compose.yaml is a valid Compose file and runs exactly the processes `tandem up` runs."""
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from cli.up import build_parser, launch_commands

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT.parent / "shared" / "schemas" / "compose-spec.json"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_matches_the_schema(compose):
    if not SCHEMA.exists():
        pytest.skip(f"{SCHEMA} is missing (the shared schemas sit beside the checkout)")
    schema = json.loads(SCHEMA.read_text())
    # The file names draft-07 as "https://json-schema.org/draft-07/schema" (no "#"), which jsonschema does not map
    # to a draft by itself: say it.
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(compose)


def test_services_run_the_launchers_commands(compose):
    ns = build_parser().parse_args(compose["x-tandem-up"])
    expected = launch_commands(ns, address=lambda name: name)  # in compose a service's name is its host
    assert {name: svc["command"] for name, svc in compose["services"].items() if "profiles" not in svc} == expected


def test_one_prefill_two_decode_and_a_router(compose):
    # Prometheus and Grafana only with `--profile monitoring` (tests/test_monitoring.py).
    default = [name for name, svc in compose["services"].items() if "profiles" not in svc]
    assert sorted(default) == ["decode-0", "decode-1", "prefill-0", "router"]


def test_workers_reserve_distinct_gpus_and_check_their_own_port(compose):
    gpus = []
    for name, svc in compose["services"].items():
        if name == "router" or "profiles" in svc:
            continue
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
        gpus += device["device_ids"]
        port = svc["command"][svc["command"].index("--port") + 1]
        health = " ".join(svc["healthcheck"]["test"])
        assert re.search(rf"127\.0\.0\.1:{port}\b", health), (name, health)
    assert len(gpus) == len(set(gpus)) == 3


def test_router_publishes_its_ports_and_checks_health(compose):
    router = compose["services"]["router"]
    cmd = router["command"]
    http, grpc_port = cmd[cmd.index("--http-port") + 1], cmd[cmd.index("--grpc-port") + 1]
    assert f"{http}:{http}" in router["ports"] and f"{grpc_port}:{grpc_port}" in router["ports"]
    assert f"127.0.0.1:{http}/health" in " ".join(router["healthcheck"]["test"])
