"""docs/monitoring: Prometheus scrapes every process compose.yaml and `tandem up` start and loads the alert rules,
which pass promtool's checks and unit tests; Grafana's provisioning points at that Prometheus, and the dashboard is
well formed and queries only metrics Tandem declares. (That each panel's query and each alert finds its series in a
real Prometheus scraping a live stack: tests/e2e/test_prometheus_e2e.py.)"""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram

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


# ------------------------------------------------------------------------------------------------ alert rules
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: prometheus)")


@needs_promtool
def test_alert_rules_pass_promtool_check_and_their_unit_tests():
    check = subprocess.run([PROMTOOL, "check", "rules", "alerts.yml"], cwd=MONITORING, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS: 6 rules found" in check.stdout, check.stdout + check.stderr
    unit = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=MONITORING, capture_output=True,
                          text=True, timeout=60)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


def test_the_six_alerts_each_have_a_duration_severity_and_summary():
    (group,) = yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]
    rules = {r["alert"]: r for r in group["rules"]}
    assert sorted(rules) == ["TandemHighTimeToFirstToken", "TandemInstanceDown", "TandemInstanceMismatched",
                             "TandemKvCacheNearlyFull", "TandemKvTransferFailures", "TandemQueueBacklog"]
    for name, rule in rules.items():
        assert rule["for"] and rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    tested = {t["alertname"] for t in yaml.safe_load((MONITORING / "alerts_test.yml").read_text())["tests"][0][
        "alert_rule_test"]}
    assert tested == set(rules)


@needs_promtool
@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-local.yml", "prometheus-tls.yml"])
def test_every_prometheus_config_loads_the_alert_rules(config):
    assert yaml.safe_load((MONITORING / config).read_text())["rule_files"] == ["alerts.yml"]
    r = subprocess.run([PROMTOOL, "check", "config", config], cwd=MONITORING, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS: 6 rules found" in r.stdout, r.stdout + r.stderr


def test_compose_mounts_the_alert_rules_beside_prometheus_yml():
    volumes = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["prometheus"]["volumes"]
    assert "./docs/monitoring/alerts.yml:/etc/prometheus/alerts.yml:ro" in volumes
    assert "./docs/monitoring/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in volumes


def test_every_dashboard_and_alert_query_names_a_declared_metric():
    """A typo in a query (or a family renamed in the code) shows here, without a live stack: every `tandem:` name
    in the dashboard and the rules is a family Tandem declares, with a suffix its type exports."""
    import kv_transfer.metrics  # noqa: F401 - the modules that declare families
    import router.admission  # noqa: F401
    import router.http  # noqa: F401
    from serving.metrics import DECLARED

    suffixes = {Counter: ("_total",), Gauge: ("",), Histogram: ("_bucket", "_count", "_sum")}
    exported = {f.name + s for f in DECLARED for s in suffixes[f.kind]}
    dashboard = json.loads((MONITORING / "grafana/dashboards/tandem.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"]]
    exprs += [r["expr"] for g in yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    names = {n for e in exprs for n in re.findall(r"tandem:(\w+)", e)}
    assert len(names) >= 20 and not names - exported, sorted(names - exported)
