"""deploy/k8s, checked offline (no cluster exists here): the kustomize output against the Kubernetes
1.32 schemas (kubernetes-validate, strict), the two CRD objects by what they must select and
contain (`promtool check rules` on the PrometheusRule's groups), the rosters by hotswap's own
loader, the front's config by `haproxy -c`, and the generated files against their sources."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from config import parse_roster

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
K8S_VERSION = "1.32.0"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
REQUIRE_TOOLS = os.environ.get("HOTSWAP_REQUIRE_TOOLS") == "1"


def need(tool: str) -> str:
    path = shutil.which(tool) or (f"/usr/sbin/{tool}" if Path(f"/usr/sbin/{tool}").exists() else None)
    if path is None:
        if REQUIRE_TOOLS:
            pytest.fail(f"{tool} is missing and HOTSWAP_REQUIRE_TOOLS=1")
        pytest.skip(f"{tool} is not installed")
    return path


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    """`kubectl kustomize deploy/k8s`, by kind/name."""
    out = subprocess.run([need("kubectl"), "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def by_kind(rendered: dict[str, dict], kind: str) -> list[dict]:
    return [d for d in rendered.values() if d["kind"] == kind]


def test_the_generated_files_are_current():
    run = subprocess.run([str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").exists() else "python3",
                          str(K8S / "render.py"), "--check"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def test_the_prometheusrule_is_the_shipped_alerts():
    alerts = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    rule = yaml.safe_load((K8S / "prometheusrule.yaml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


def test_every_core_object_validates_strictly(rendered):
    core = [d for d in rendered.values() if d["kind"] not in CRD_KINDS]
    assert {d["kind"] for d in core} == {"Namespace", "ConfigMap", "Service", "StatefulSet", "Deployment"}
    for doc in core:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert {d["kind"] for d in rendered.values()} - {d["kind"] for d in core} == CRD_KINDS


def test_the_validator_refuses_a_misspelt_field(rendered):
    broken = copy.deepcopy(rendered["StatefulSet/hotswap"])
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_each_pod_has_a_valid_roster_and_the_environment_it_references(rendered):
    sts = rendered["StatefulSet/hotswap"]
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    rosters = sorted((K8S / "rosters").glob("*.yaml"))
    assert [p.stem for p in rosters] == [f"hotswap-{i}" for i in range(sts["spec"]["replicas"])]
    assert "/etc/hotswap/$(POD_NAME).yaml" in container["args"]
    env = {e["name"] for e in container["env"]}
    secret_keys = set(yaml.safe_load((K8S / "secret.example.yaml").read_text())["stringData"])
    assert {e["valueFrom"]["secretKeyRef"]["key"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})} <= secret_keys
    roster_cm = next(d for d in by_kind(rendered, "ConfigMap") if d["metadata"]["name"].startswith("hotswap-rosters"))
    for path in rosters:
        text = roster_cm["data"][path.name]
        referenced = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
        assert referenced <= env, f"{path.name} references {referenced - env}, which the pod does not set"
        roster = parse_roster(text, str(path), {name: f"x-{name}" for name in referenced})  # distinct, as keys must be
        assert roster.listen.port == container["ports"][0]["containerPort"]
        # The pod must outlive its drain: the port stays open for max(notice, drain), then engines stop.
        needed = max(roster.listen.drain_notice_s, roster.swap.drain_timeout_s) + roster.swap.kill_grace_s
        assert pod["terminationGracePeriodSeconds"] >= needed
        # The readiness probe must notice the drain well within the notice period.
        probe = container["readinessProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] < roster.listen.drain_notice_s
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_prometheus_scrapes_the_service_the_alerts_name(rendered):
    monitor = rendered["ServiceMonitor/hotswap"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selected = [s for s in by_kind(rendered, "Service")
                if all(s["metadata"].get("labels", {}).get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())]
    # One Service, named `hotswap`: Prometheus Operator makes its name the job label, and the
    # shipped alerts select job="hotswap" (two Services would scrape every pod twice).
    assert [s["metadata"]["name"] for s in selected] == ["hotswap"]
    assert 'job="hotswap"' in (REPO / "deploy" / "prometheus" / "alerts.yml").read_text()
    ports = {p["name"] for p in selected[0]["spec"]["ports"]}
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [("http", "/metrics")] and "http" in ports


def test_prometheus_sends_a_key_each_roster_takes_for_metrics(rendered):
    """With client keys in a roster, /metrics takes a key with metrics: true: the ServiceMonitor's
    bearer token must be the Secret entry that the pods map to such a key's ${VAR}."""
    from router.keys import KeyTable

    [endpoint] = rendered["ServiceMonitor/hotswap"]["spec"]["endpoints"]
    assert endpoint["authorization"]["type"] == "Bearer"
    credentials = endpoint["authorization"]["credentials"]
    assert credentials["key"] in yaml.safe_load((K8S / "secret.example.yaml").read_text())["stringData"]
    container = rendered["StatefulSet/hotswap"]["spec"]["template"]["spec"]["containers"][0]
    [variable] = [e["name"] for e in container["env"] if e.get("valueFrom", {}).get("secretKeyRef") == {
        "name": credentials["name"], "key": credentials["key"]}]
    for path in sorted((K8S / "rosters").glob("*.yaml")):
        text = path.read_text()
        env = {name: f"value-of-{name}" for name in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text)}
        table = KeyTable(parse_roster(text, str(path), env).auth)
        grant = table.identify(env.get(variable, "").encode())
        assert table.metrics_auth and grant is not None and grant.metrics, f"{path.name}: ${{{variable}}} opens no /metrics"


def test_the_prometheusrule_passes_promtool(rendered, tmp_path):
    rule = rendered["PrometheusRule/hotswap"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and set(rule["spec"]) == {"groups"}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    run = subprocess.run([need("promtool"), "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_front_routes_every_roster_name_and_haproxy_accepts_its_config(rendered, tmp_path):
    front_cm = next(d for d in by_kind(rendered, "ConfigMap") if d["metadata"]["name"].startswith("hotswap-front"))
    cfg = front_cm["data"]["haproxy.cfg"]
    names = {n for p in (K8S / "rosters").glob("*.yaml")
             for m in yaml.safe_load(p.read_text())["models"] for n in [m["name"], *m.get("aliases", [])]}
    routed = set(re.findall(r"var\(txn\.model\) -m str (\S+) \}", cfg))
    assert routed == names
    deployment = rendered["Deployment/hotswap-front"]
    assert deployment["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == front_cm["metadata"]["name"]
    # The agent-check lines carry the nodes' node.agent_key from HAProxy's environment, from the pods' Secret.
    [haproxy_container] = deployment["spec"]["template"]["spec"]["containers"]
    front_env = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in haproxy_container.get("env", [])}
    assert set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", cfg)) == {"HOTSWAP_AGENT_KEY"} <= set(front_env)
    pod_env = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
               for e in rendered["StatefulSet/hotswap"]["spec"]["template"]["spec"]["containers"][0]["env"]
               if "secretKeyRef" in e.get("valueFrom", {})}
    assert front_env["HOTSWAP_AGENT_KEY"] == pod_env["HOTSWAP_AGENT_KEY"], "the front and the nodes share one agent key"
    assert all(f'agent-send "${{HOTSWAP_AGENT_KEY}} ' in line for line in cfg.splitlines() if "agent-send" in line)
    (tmp_path / "haproxy.cfg").write_text(cfg)
    (tmp_path / "models.lua").write_text(front_cm["data"]["models.lua"])  # loaded from beside the config
    run = subprocess.run([need("haproxy"), "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and "Configuration file is valid" in run.stdout + run.stderr, run.stdout + run.stderr
