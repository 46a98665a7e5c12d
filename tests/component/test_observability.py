"""The alert rules, the scrape config and the Grafana dashboard, checked with the real tools.

- `promtool check rules` / `check config` on the shipped files, and `promtool test rules` on
  the alert logic (each alert fires on the situation it is named after, and not on a healthy one);
- every metric name the rules and the dashboard use is in a real router's /metrics, with the
  labels they select on (after swaps, a gate refusal and its restart, a failed wake step);
- a real Prometheus scraping that router loads the rules, fires the gate-refusal alert, and
  answers EACH dashboard query with data;
- docs/observability.md lists exactly the metrics the router exports, and every alert.

Needs Debian's `prometheus` package (`bash .ci/install-tools.sh`). Without it the tests that
need the tools skip, unless HOTSWAP_REQUIRE_TOOLS=1 (CI), where they fail.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support import RouterProcess, free_port, roster_dict, sim_model, until

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
SCRAPE = REPO / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "hotswap-dashboard.json"
DOC = REPO / "docs" / "observability.md"

# What the Grafana variables become when the queries are sent to Prometheus directly.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m", "${model}": ".*", "$model": ".*",
                     "${group}": ".*", "$group": ".*"}
METRIC_NAME = re.compile(r"\bhotswap_[a-zA-Z0-9_]+")
SELECTOR = re.compile(r"\b(hotswap_[a-zA-Z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")


def tool(name: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    why = f"`{name}` is not installed: run `bash .ci/install-tools.sh` (Debian's prometheus package)"
    if os.environ.get("HOTSWAP_REQUIRE_TOOLS") == "1":
        pytest.fail(why + " -- HOTSWAP_REQUIRE_TOOLS=1 says the tools must be there")
    pytest.skip(why)


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, **kw)


def get_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def alert_rules() -> list[dict[str, Any]]:
    return [rule for g in yaml.safe_load(ALERTS.read_text())["groups"] for rule in g["rules"] if "alert" in rule]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title / refId, PromQL) for every query of every panel."""
    out = []
    for panel in dashboard()["panels"]:
        for t in panel.get("targets", []):
            out.append((f"{panel['title']} / {t['refId']}", t["expr"]))
    return out


def substitute(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a Grafana variable the test does not know is left in: {expr}"
    return expr


# -- static checks --------------------------------------------------------------------------------

def test_promtool_accepts_the_alert_rules():
    result = run([tool("promtool"), "check", "rules", str(ALERTS)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_every_alert_tells_the_operator_what_it_means_and_where_to_look():
    doc = DOC.read_text()
    names = [r["alert"] for r in alert_rules()]
    assert len(names) == len(set(names))
    for rule in alert_rules():
        a = rule["annotations"]
        assert a["summary"] and len(a["description"]) > 150, rule["alert"]
        assert "/admin/" in a["description"] or "up{" in rule["expr"], f"{rule['alert']}: say where to look"
        assert rule["labels"]["severity"] in ("warning", "critical")
        anchor = a["runbook"].split("#", 1)[1]
        assert anchor == rule["alert"].lower() and f"\n### {rule['alert']}\n" in doc, f"{rule['alert']} has no section in {DOC.name}"


def test_promtool_accepts_the_example_scrape_config(tmp_path):
    promtool = tool("promtool")
    result = run([promtool, "check", "config", str(SCRAPE)])
    assert result.returncode == 0, result.stdout + result.stderr
    config = live_config("127.0.0.1:8080")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = run([promtool, "check", "config", str(tmp_path / "prometheus.yml")])
    assert result.returncode == 0, result.stdout + result.stderr


# The alert logic (expression, `for`, labels) on synthetic series. promtool compares rendered
# annotations too, so this runs on a copy of the rules without them; the annotations' templates
# are checked by `promtool check rules` and rendered by the live Prometheus below.
M = 'group="default",model="b"'
RULE_TESTS: list[dict[str, Any]] = [
    {"interval": "1m", "input_series": [{"series": 'up{job="hotswap",instance="gpu1:8080"}', "values": "1 0x5"},
                                        {"series": 'up{job="hotswap",instance="gpu2:8080"}', "values": "1x6"}],
     "alert_rule_test": [{"eval_time": "2m", "alertname": "HotswapRouterDown", "exp_alerts": []},
                         {"eval_time": "4m", "alertname": "HotswapRouterDown",
                          "exp_alerts": [{"exp_labels": {"severity": "critical", "job": "hotswap", "instance": "gpu1:8080"}}]}]},
    {"interval": "1m", "input_series": [
        {"series": f'hotswap_gate_verdicts_total{{{M},result="refused"}}', "values": "0 0 1 1 1"},
        {"series": f'hotswap_gate_verdicts_total{{{M},result="passed"}}', "values": "0 1 2 3 4"},
        {"series": f'hotswap_gate_verdicts_total{{{M},result="allowed"}}', "values": "0 0 0 1 1"}],
     "alert_rule_test": [
         {"eval_time": "1m", "alertname": "HotswapGateRefused", "exp_alerts": []},
         {"eval_time": "3m", "alertname": "HotswapGateRefused",
          "exp_alerts": [{"exp_labels": {"severity": "warning", "group": "default", "model": "b", "result": "refused"}}]},
         {"eval_time": "2m", "alertname": "HotswapPromotedDespiteRefusal", "exp_alerts": []},
         {"eval_time": "4m", "alertname": "HotswapPromotedDespiteRefusal",
          "exp_alerts": [{"exp_labels": {"severity": "critical", "group": "default", "model": "b", "result": "allowed"}}]}]},
    {"interval": "1m", "input_series": [{"series": f"hotswap_midlife_collapses_total{{{M}}}", "values": "0 0 1"},
                                        {"series": 'hotswap_midlife_collapses_total{group="default",model="a"}', "values": "0 0 0"}],
     "alert_rule_test": [{"eval_time": "2m", "alertname": "HotswapMidlifeCollapse",
                          "exp_alerts": [{"exp_labels": {"severity": "warning", "group": "default", "model": "b"}}]}]},
    {"interval": "1m", "input_series": [
        {"series": f'hotswap_engine_restarts_total{{{M},reason="gate"}}', "values": "0 1 2 2x10"},
        {"series": f'hotswap_engine_restarts_total{{{M},reason="failed"}}', "values": "0 0 0 1x10"},
        {"series": 'hotswap_engine_restarts_total{group="default",model="a",reason="gate"}', "values": "0 1 1x10"}],
     "alert_rule_test": [{"eval_time": "2m", "alertname": "HotswapEngineRestartLoop", "exp_alerts": []},
                         {"eval_time": "4m", "alertname": "HotswapEngineRestartLoop", "exp_alerts": []},  # pending
                         {"eval_time": "9m", "alertname": "HotswapEngineRestartLoop",
                          "exp_alerts": [{"exp_labels": {"severity": "critical", "group": "default", "model": "b"}}]}]},
    {"interval": "15s", "input_series": [  # a young router: two quick restarts extrapolate to 3+, and must not page
        {"series": 'hotswap_engine_restarts_total{group="default",model="c",reason="gate"}', "values": "0 1 2 2x40"}],
     "alert_rule_test": [{"eval_time": "1m", "alertname": "HotswapEngineRestartLoop", "exp_alerts": []},
                         {"eval_time": "10m", "alertname": "HotswapEngineRestartLoop", "exp_alerts": []}]},
    {"interval": "1m", "input_series": [{"series": f'hotswap_engine_state{{{M},state="failed"}}', "values": "0 1x7"},
                                        {"series": f'hotswap_engine_state{{{M},state="awake"}}', "values": "1 0x7"}],
     "alert_rule_test": [{"eval_time": "4m", "alertname": "HotswapEngineFailed", "exp_alerts": []},
                         {"eval_time": "7m", "alertname": "HotswapEngineFailed",
                          "exp_alerts": [{"exp_labels": {"severity": "critical", "group": "default", "model": "b"}}]}]},
    {"interval": "1m", "input_series": [  # b's series appears with its first failure; c's existed at 0
        {"series": f'hotswap_swap_phase_failures_total{{{M},phase="reload_weights"}}', "values": "_ 1x20"},
        {"series": 'hotswap_swap_phase_failures_total{group="default",model="c",phase="sleep"}', "values": "0 0 1x20"},
        {"series": 'hotswap_swap_phase_failures_total{group="default",model="c",phase="gate"}', "values": "0x20"}],
     "alert_rule_test": [
         {"eval_time": "2m", "alertname": "HotswapWakeStepFailed",
          "exp_alerts": [{"exp_labels": {"severity": "warning", "group": "default", "model": "b", "phase": "reload_weights"}},
                         {"exp_labels": {"severity": "warning", "group": "default", "model": "c", "phase": "sleep"}}]},
         {"eval_time": "15m", "alertname": "HotswapWakeStepFailed", "exp_alerts": []}]},
    {"interval": "1m", "input_series": [  # b waits 60-120 s, a under 1 s
        {"series": f'hotswap_queue_wait_seconds_bucket{{group="default",model="b",le="{le}"}}', "values": v}
        for le, v in [("1", "0x20"), ("60", "0x20"), ("120", "0+10x20"), ("+Inf", "0+10x20")]] + [
        {"series": f'hotswap_queue_wait_seconds_bucket{{group="default",model="a",le="{le}"}}', "values": "0+10x20"} for le in ("1", "60", "120", "+Inf")],
     "alert_rule_test": [{"eval_time": "8m", "alertname": "HotswapQueueWaitHigh", "exp_alerts": []},
                         {"eval_time": "15m", "alertname": "HotswapQueueWaitHigh",
                          "exp_alerts": [{"exp_labels": {"severity": "warning", "model": "b"}}]}]},
    {"interval": "1m", "input_series": [
        {"series": f'hotswap_swap_duration_seconds_bucket{{group="{g}",to_model="m",result="ok",le="{le}"}}', "values": v}
        for g, rows in [("slow", [("60", "0x10"), ("120", "0x10"), ("300", "0+1x10"), ("+Inf", "0+1x10")]),
                        ("fast", [("60", "0+1x10"), ("120", "0+1x10"), ("300", "0+1x10"), ("+Inf", "0+1x10")])]
        for le, v in rows],
     "alert_rule_test": [{"eval_time": "5m", "alertname": "HotswapSwapSlow",
                          "exp_alerts": [{"exp_labels": {"severity": "warning", "group": "slow", "to_model": "m"}}]}]},
    {"interval": "1m", "input_series": [
        {"series": f"hotswap_acceptance_baseline{{{M}}}", "values": "2.6x10"},
        {"series": f"hotswap_acceptance_observed{{{M}}}", "values": "2.6 1x9"},       # collapsed
        {"series": 'hotswap_acceptance_baseline{group="default",model="c"}', "values": "2.6x10"},
        {"series": 'hotswap_acceptance_observed{group="default",model="c"}', "values": "2.4x10"},  # healthy
        {"series": 'hotswap_acceptance_baseline{group="default",model="d"}', "values": "1.02x10"},  # no gain to lose
        {"series": 'hotswap_acceptance_observed{group="default",model="d"}', "values": "1x10"}],
     "alert_rule_test": [{"eval_time": "4m", "alertname": "HotswapAcceptanceBelowBaseline", "exp_alerts": []},
                         {"eval_time": "8m", "alertname": "HotswapAcceptanceBelowBaseline",
                          "exp_alerts": [{"exp_labels": {"severity": "warning", "group": "default", "model": "b"}}]}]},
    {"interval": "1m", "input_series": [
        {"series": 'hotswap_requests_total{model="b",endpoint="chat",status="503"}', "values": "0+1x20"},
        {"series": 'hotswap_requests_total{model="b",endpoint="chat",status="200"}', "values": "0+3x20"},
        {"series": 'hotswap_requests_total{model="a",endpoint="chat",status="200"}', "values": "0+9x20"},
        {"series": 'hotswap_requests_total{model="a",endpoint="chat",status="429"}', "values": "0+9x20"}],
     "alert_rule_test": [{"eval_time": "16m", "alertname": "HotswapHighErrorRate",
                          "exp_alerts": [{"exp_labels": {"severity": "warning", "model": "b"}}]}]},
    # Clients that go away (499) are no server error, and do not hide the real ones of c (1 in 11 answered).
    {"interval": "1m", "input_series": [
        {"series": 'hotswap_requests_total{model="a",endpoint="chat",status="499"}', "values": "0+9x20"},
        {"series": 'hotswap_requests_total{model="a",endpoint="chat",status="200"}', "values": "0+1x20"},
        {"series": 'hotswap_requests_total{model="c",endpoint="chat",status="502"}', "values": "0+1x20"},
        {"series": 'hotswap_requests_total{model="c",endpoint="chat",status="200"}', "values": "0+10x20"},
        {"series": 'hotswap_requests_total{model="c",endpoint="chat",status="499"}', "values": "0+30x20"}],
     "alert_rule_test": [{"eval_time": "16m", "alertname": "HotswapHighErrorRate",
                          "exp_alerts": [{"exp_labels": {"severity": "warning", "model": "c"}}]}]},
    {"interval": "1m", "input_series": [
        {"series": f'hotswap_queued_requests{{group="g1",model="{m}"}}', "values": v} for m, v in [("a", "0x10"), ("b", "3x10")]] + [
        {"series": f'hotswap_engine_state{{group="g1",model="{m}",state="{s}"}}', "values": "0x10"}
        for m in ("a", "b") for s in ("awake", "waking", "verifying", "draining", "booting")] + [
        {"series": 'hotswap_engine_state{group="g1",model="b",state="failed"}', "values": "1x10"},
        {"series": 'hotswap_queued_requests{group="g2",model="c"}', "values": "5x10"},
        {"series": 'hotswap_engine_state{group="g2",model="c",state="waking"}', "values": "1x10"}],
     "alert_rule_test": [{"eval_time": "3m", "alertname": "HotswapGroupStalled", "exp_alerts": []},
                         {"eval_time": "7m", "alertname": "HotswapGroupStalled",
                          "exp_alerts": [{"exp_labels": {"severity": "critical", "group": "g1"}}]}]},
]


def test_each_alert_fires_on_its_situation_and_not_on_a_healthy_one(tmp_path):
    promtool = tool("promtool")
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))
    tested = {t["alertname"] for case in RULE_TESTS for t in case["alert_rule_test"]}
    assert tested == {r["alert"] for r in alert_rules()}, "every alert needs a case here"
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": RULE_TESTS}))
    result = run([promtool, "test", "rules", str(tmp_path / "tests.yml")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboard_is_a_well_formed_grafana_dashboard():
    d = dashboard()
    assert d["schemaVersion"] >= 36 and d["uid"] and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("group", "model"):
        assert variables[name]["allValue"] == ".*" and variables[name]["datasource"]["uid"] == "${datasource}"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    panels = [p for p in d["panels"] if p["type"] != "row"]
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles))
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["expr"].strip() and t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
    covered = " ".join(e for _, e in dashboard_queries())
    for family in ("hotswap_requests_total", "hotswap_request_duration_seconds", "hotswap_request_ttfb_seconds",
                   "hotswap_in_flight_requests", "hotswap_queued_requests", "hotswap_queue_wait_seconds", "hotswap_engine_state",
                   "hotswap_swaps_total", "hotswap_swap_duration_seconds", "hotswap_swap_phase_duration_seconds",
                   "hotswap_acceptance_baseline", "hotswap_acceptance_observed", "hotswap_gate_verdicts_total",
                   "hotswap_engine_restarts_total", "hotswap_engine_boot_duration_seconds"):
        assert family in covered, f"no panel shows {family}"


# -- a real router with simulated engines, and a real Prometheus scraping it ----------------------------

@dataclass
class Exported:
    """The router's /metrics, parsed: sample name -> (family, type, label names)."""

    text: str
    samples: dict[str, tuple[str, str, set[str]]] = field(default_factory=dict)
    families: dict[str, tuple[str, set[str]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "Exported":
        self = cls(text)
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):  # prometheus-client's creation timestamps, not for queries
                continue
            labels = {k for s in family.samples for k in s.labels} - {"le"}
            self.families[family.name] = (family.type, labels)
            for s in family.samples:
                if not s.name.endswith("_created"):
                    entry = self.samples.setdefault(s.name, (family.name, family.type, set()))
                    entry[2].update(set(s.labels) - ({"le"} if not s.name.endswith("_bucket") else set()))
        return self


class PrometheusProcess:
    """`prometheus` on a free loopback port, its config and TSDB in a temporary directory."""

    def __init__(self, config: dict[str, Any], workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 20) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log()}")
            with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                return r.status == 200
        until(ready, timeout, f"prometheus ready at {self.url}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = get_json(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def api(self, path: str) -> Any:
        answer = get_json(self.url + path)
        assert answer["status"] == "success", answer
        return answer["data"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def live_config(target: str) -> dict[str, Any]:
    """The shipped example, pointed at `target`, scraping and evaluating every second, with the
    bearer token the example's comment asks for (the roster below has client keys)."""
    config = yaml.safe_load(SCRAPE.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    config["rule_files"] = [str(ALERTS)]
    [job] = config["scrape_configs"]
    assert job["job_name"] == "hotswap"  # HotswapRouterDown selects up{job="hotswap"}
    job["static_configs"][0]["targets"] = [target]
    job["authorization"] = {"type": "Bearer", "credentials": METRICS_KEY}
    return config


@dataclass
class Live:
    router: RouterProcess
    prometheus: Optional[PrometheusProcess]
    exported: Exported


ROSTER = roster_dict(
    sim_model("a", default=True),
    sim_model("b", spec=True, draft_restore="none"),  # loses its draft at wake: refused, restarted
    sim_model("c", spec=True),                        # draft_restore: reload (the reload_draft phase)
    auth={"keys": [{"key": "${OBS_KEY}", "name": "obs", "models": ["*"]},  # so per-key counts are exported too
                   {"key": "${OBS_METRICS_KEY}", "name": "prometheus", "metrics": True}]},  # which makes /metrics take a key
)
OBS_KEY = "obs-client-key"
METRICS_KEY = "obs-metrics-key"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("observability")
    (workdir / "router").mkdir()
    router = RouterProcess(ROSTER, workdir / "router", env={"OBS_KEY": OBS_KEY, "OBS_METRICS_KEY": METRICS_KEY})
    prometheus = None
    try:
        if shutil.which("prometheus"):  # without it, the /metrics checks still run
            (workdir / "prometheus").mkdir()
            prometheus = PrometheusProcess(live_config(f"127.0.0.1:{router.port}"), workdir / "prometheus")
            prometheus.wait_ready()
        asyncio.run(router.wait_ready())
        if prometheus is not None:  # a scrape before any traffic, so every counter's first increase shows
            until(lambda: prometheus.query('hotswap_gate_verdicts_total{model="b",result="refused"} == 0'), 20,
                  "prometheus scraped the router")
        drive(router)
        exported = Exported.parse(fetch(router.url + "/metrics", key=METRICS_KEY))
        total = sum(s.value for f in text_string_to_metric_families(exported.text) for s in f.samples
                    if s.name == "hotswap_requests_total")
        if prometheus is not None:  # and a scrape after the last of the traffic
            until(lambda: prometheus.query(f"sum(hotswap_requests_total) == {total}"), 20,
                  f"prometheus scraped the end of the traffic ({total:.0f} requests)")
        yield Live(router, prometheus, exported)
    finally:
        if prometheus is not None:
            prometheus.stop()
        code = router.stop()
    assert code == 0, router.log()


def fetch(url: str, method: str = "GET", body: Optional[dict] = None, key: Optional[str] = None) -> str:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.read().decode()


def drive(router: RouterProcess) -> None:
    """Swaps through every wake path, a refusal and its restart, a failed wake step, streams, errors."""
    c = openai.OpenAI(base_url=router.url + "/v1", api_key=OBS_KEY, max_retries=0, timeout=30)

    def ask(model: str, **kw) -> str:
        return c.completions.create(model=model, prompt="hello", max_tokens=8, temperature=0, **kw).choices[0].text

    try:
        assert ask("b")  # refused at wake (draft lost), restarted cold, re-verified, answered
        assert ask("c")  # woken with the draft reloaded
        status = json.loads(fetch(router.url + "/admin/status"))
        a_port = next(e["port"] for e in status["engines"] if e["name"] == "a")
        fetch(f"http://127.0.0.1:{a_port}/sim/faults", "POST", {"step": "wake_weights", "kind": "http500", "times": 1})
        with pytest.raises(openai.InternalServerError):
            ask("a")  # the wake fails: a goes FAILED, its waiter gets a 503
        assert ask("a")  # restarted cold (reason "failed")
        assert "".join(ch.choices[0].text for ch in ask_stream(c, "a") if ch.choices)
        assert c.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=4).choices[0].message.content
        with pytest.raises(openai.NotFoundError):
            ask("no-such-model")
        assert ask("b") and ask("a")
    finally:
        c.close()


def ask_stream(c: openai.OpenAI, model: str):
    return c.completions.create(model=model, prompt="hello", max_tokens=8, temperature=0, stream=True)


def referenced(expr: str) -> list[str]:
    return METRIC_NAME.findall(expr)


def test_every_metric_the_alerts_and_the_dashboard_use_is_exported_with_those_labels(live):
    exported = live.exported
    sources = [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()] + [(f"panel {t}", e) for t, e in dashboard_queries()]
    problems = []
    for where, expr in sources:
        for name in referenced(expr):
            if name not in exported.samples:
                problems.append(f"{where}: {name} is not in the router's /metrics")
        for name, matchers in SELECTOR.findall(expr):
            if name in exported.samples:
                labels = exported.samples[name][2]
                problems += [f"{where}: {name} has no label {label!r} (it has {sorted(labels)})"
                             for label in MATCHER.findall(matchers) if label not in labels]
    assert not problems, "\n".join(problems)
    # the series the alert cases feed promtool have the label names of the real ones
    for case in RULE_TESTS:
        for series in case["input_series"]:
            name, _, labels = series["series"].partition("{")
            if name == "up":
                continue
            real = exported.samples[name][2]
            assert set(MATCHER.findall(labels)) == real, f"{series['series']}: the router exports {name} with {sorted(real)}"


def test_the_scenario_produced_the_series_the_operators_watch(live):
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(live.exported.text) for s in f.samples}

    def value(name: str, **labels: str) -> float:
        return values.get((name, tuple(sorted({"group": "", **labels}.items()))), 0.0)

    assert value("hotswap_gate_verdicts_total", model="b", result="refused") == 2  # b was woken twice
    assert value("hotswap_engine_restarts_total", model="b", reason="gate") == 2
    assert value("hotswap_engine_restarts_total", model="a", reason="failed") == 1
    assert value("hotswap_swap_phase_failures_total", model="a", phase="wake_weights") == 1
    assert value("hotswap_swap_phase_duration_seconds_count", model="c", phase="reload_draft") >= 1
    assert value("hotswap_swaps_total", from_model="c", to_model="a", result="failed") == 1
    text = live.exported.text
    assert 'stream="true"' in text and 'model="_unknown"' in text


def prometheus_of(live: Live) -> PrometheusProcess:
    tool("prometheus")
    assert live.prometheus is not None
    return live.prometheus


def test_each_dashboard_query_returns_data_from_a_real_prometheus(live):
    prometheus = prometheus_of(live)
    empty = []
    for where, expr in dashboard_queries():
        query = substitute(expr)

        def answered() -> list:
            result = prometheus.query(query)
            # NaN is what histogram_quantile and 0/0 give without observations: not data
            return [r for r in result if not math.isnan(float(r["value"][1]))]

        try:
            until(answered, 10, where, interval=0.25)
        except AssertionError:
            empty.append(f"{where}: {query}\n  -> {prometheus.query(query)}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)


def test_prometheus_loads_the_rules_and_alerts_on_the_refusal_and_the_failed_wake(live):
    prometheus = prometheus_of(live)
    rules = [r for g in prometheus.api("/api/v1/rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}

    def evaluated() -> bool:
        fresh = [r for g in prometheus.api("/api/v1/rules")["groups"] for r in g["rules"]]
        bad = [(r["name"], r.get("lastError")) for r in fresh if r["health"] != "ok"]
        assert not bad, bad
        return all(r["health"] == "ok" for r in fresh)

    until(evaluated, 10, "every rule evaluated without error")

    def firing() -> dict[tuple[str, str], dict]:
        alerts = prometheus.api("/api/v1/alerts")["alerts"]
        found = {(a["labels"]["alertname"], a["labels"].get("model", "")): a for a in alerts if a["state"] == "firing"}
        wanted = {("HotswapGateRefused", "b"), ("HotswapWakeStepFailed", "a")}
        return found if wanted <= set(found) else {}

    alerts = until(firing, 15, "HotswapGateRefused{model=b} and HotswapWakeStepFailed{model=a} firing")
    refused = alerts[("HotswapGateRefused", "b")]["annotations"]
    assert refused["summary"] == "Promotion gate refused b after a wake"
    assert "engines[b].last_verdict" in refused["description"] and "docs/gate.md" in refused["description"]
    assert "phase" in alerts[("HotswapWakeStepFailed", "a")]["labels"]
    quiet = {name for name, _ in alerts} & {"HotswapRouterDown", "HotswapEngineRestartLoop", "HotswapPromotedDespiteRefusal",
                                             "HotswapMidlifeCollapse", "HotswapGroupStalled"}
    assert not quiet, f"alerts firing on a healthy run: {quiet}"


# -- the docs ------------------------------------------------------------------------------------

DOC_ROW = re.compile(r"^\| `(hotswap_[a-z0-9_]+)` \| (counter|gauge|histogram) \| ([^|]*) \|", re.M)


def test_the_docs_list_exactly_the_metrics_the_router_exports(live):
    documented = {}
    for name, kind, labels in DOC_ROW.findall(DOC.read_text()):
        documented[name] = (kind, {label.strip(" `") for label in labels.split(",") if label.strip(" `") not in ("", "(none)")})
    real = {}
    for family, (kind, labels) in live.exported.families.items():
        real[family + "_total" if kind == "counter" else family] = (kind, labels)
    assert documented == real, (
        "docs/observability.md's metric table differs from the router's /metrics:\n"
        f"  only in the docs: {sorted(set(documented) - set(real))}\n  only exported: {sorted(set(real) - set(documented))}\n"
        + "\n".join(f"  {n}: docs {documented[n]} vs /metrics {real[n]}" for n in set(documented) & set(real) if documented[n] != real[n]))
