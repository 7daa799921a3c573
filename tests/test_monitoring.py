"""docs/monitoring: Prometheus scrapes every process compose.yaml and `tandem up` start, Grafana's provisioning
points at that Prometheus, and the dashboard is well formed. (That each panel's query finds its series on a live
stack: tests/e2e/test_http_e2e.py.)"""
import json
from pathlib import Path

import yaml

from cli.up import build_parser, launch_commands

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "docs" / "monitoring"


def scrape_targets(path: Path) -> dict[str, set[str]]:
    config = yaml.safe_load(path.read_text())
    return {job["job_name"]: {t for sc in job["static_configs"] for t in sc["targets"]}
            for job in config["scrape_configs"]}


def metrics_targets(commands: dict[str, list[str]], host) -> dict[str, set[str]]:
    """Where each process of `commands` serves /metrics: the router on its HTTP port, workers on --metrics-port."""
    def arg(cmd, flag):
        return cmd[cmd.index(flag) + 1]

    return {"tandem-router": {f"{host('router')}:{arg(commands['router'], '--http-port')}"},
            "tandem-workers": {f"{host(name)}:{arg(cmd, '--metrics-port')}" for name, cmd in commands.items()
                               if name != "router"}}


def test_compose_prometheus_scrapes_every_tandem_service():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    commands = {name: svc["command"] for name, svc in compose["services"].items() if "profiles" not in svc}
    assert scrape_targets(MONITORING / "prometheus.yml") == metrics_targets(commands, lambda name: name)


def test_local_prometheus_scrapes_what_tandem_up_starts_by_default():
    commands = launch_commands(build_parser().parse_args([]))
    assert scrape_targets(MONITORING / "prometheus-local.yml") == metrics_targets(commands, lambda _: "127.0.0.1")


def test_compose_monitoring_services_mount_files_that_exist_and_stay_out_of_the_default_profile():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for name in ("prometheus", "grafana"):
        svc = compose["services"][name]
        assert svc["profiles"] == ["monitoring"], name  # `docker compose up` alone starts Tandem only
        for volume in svc["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), (name, source)


def test_grafana_provisioning_names_the_dashboards_datasource():
    (source,) = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    dashboard = json.loads((MONITORING / "grafana/dashboards/tandem.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert {p["datasource"]["uid"] for p in panels} == {source["uid"]}
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for p in panels:  # on the 24-column grid, no two panels overlap
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
    cells = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels]
    assert len(cells) == len(set(cells))
    assert all(t["expr"] and p["description"] for p in panels for t in p["targets"])
