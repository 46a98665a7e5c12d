"""deploy/k8s-inference (the Inference Extension as the front), checked offline: no cluster, Gateway API
implementation or endpoint picker runs here. The core objects validate strictly against the Kubernetes
1.32 schemas; the InferencePool against its own CRD's schema (gateway-api-inference-extension v1.6.0,
vendored in tests/deploy/schemas/), strictly, with the CRD's two CEL rules restated by hand; the
HTTPRoute (no Gateway API CRD is vendored) and the picker's EndpointPickerConfig (read by the picker's
own loader, which cannot run here) field by field against what they must name."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import kubernetes_validate
import pytest
import yaml

from config import parse_roster
from router.scheduling import Capacity, most_awake
from tests.deploy.test_k8s import K8S_VERSION, need

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "deploy" / "k8s-inference"
CRD = Path(__file__).parent / "schemas" / "inferencepools-v1.6.0.yaml"
CORE = {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Deployment", "StatefulSet", "NetworkPolicy"}
CUSTOM = {"InferencePool", "HTTPRoute", "ServiceMonitor", "PrometheusRule"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    out = subprocess.run([need("kubectl"), "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=60, check=True).stdout
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(out) if d}


def strict(schema: dict) -> dict:
    """The CRD's schema refusing unknown fields, as the API server's strict field validation does."""
    schema = copy.deepcopy(schema)

    def close(node: dict) -> None:
        if "properties" in node:
            node.setdefault("additionalProperties", False)
            for child in node["properties"].values():
                close(child)
        if isinstance(node.get("items"), dict):
            close(node["items"])

    close(schema)
    return schema


@pytest.fixture(scope="module")
def pool_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict(version["schema"]["openAPIV3Schema"])


def only(rendered: dict[str, dict], kind: str) -> dict:
    [doc] = [d for d in rendered.values() if d["kind"] == kind]
    return doc


def test_every_core_object_validates_strictly_and_the_haproxy_front_is_gone(rendered):
    kinds = {d["kind"] for d in rendered.values()}
    assert kinds == CORE | CUSTOM
    for doc in rendered.values():
        if doc["kind"] in CORE:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert not [name for name in rendered if "hotswap-front" in name]


def test_the_inferencepool_validates_against_its_crd_and_a_misspelt_field_does_not(rendered, pool_schema):
    pool = only(rendered, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.validate(pool, pool_schema)
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref  # CEL: port is required for a Service
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers))  # CEL: port numbers unique
    broken = copy.deepcopy(pool)
    broken["spec"]["endpointPickerRef"]["failuremode"] = broken["spec"]["endpointPickerRef"].pop("failureMode")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, pool_schema)


def test_the_pool_selects_the_hotswap_pods_on_their_port_and_names_the_picker(rendered):
    pool = only(rendered, "InferencePool")["spec"]
    sts = rendered["StatefulSet/hotswap"]["spec"]["template"]
    assert pool["selector"]["matchLabels"].items() <= sts["metadata"]["labels"].items()
    assert [p["number"] for p in pool["targetPorts"]] == [sts["spec"]["containers"][0]["ports"][0]["containerPort"]]
    service = rendered[f"Service/{pool['endpointPickerRef']['name']}"]
    [grpc] = [p for p in service["spec"]["ports"] if p["port"] == pool["endpointPickerRef"]["port"]["number"]]
    picker = rendered["Deployment/hotswap-picker"]["spec"]["template"]
    assert service["spec"]["selector"].items() <= picker["metadata"]["labels"].items()
    args = picker["spec"]["containers"][0]["args"]
    assert f"--grpc-port={_port(picker, grpc['targetPort'])}" in args
    assert "--pool-name=" + only(rendered, "InferencePool")["metadata"]["name"] in args


def _port(pod: dict, name) -> int:
    return next(p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p.get("name") == name or p["containerPort"] == name)


def test_the_httproute_sends_only_v1_to_the_pool(rendered):
    route = only(rendered, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["spec"]["parentRefs"]
    [rule] = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1/"}}]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": only(rendered, "InferencePool")["metadata"]["name"]}]


def test_the_picker_scrapes_model_server_and_weighs_awake_affinity_above_everything_else(rendered):
    picker = rendered["Deployment/hotswap-picker"]["spec"]["template"]["spec"]
    [config_arg] = [a for a in picker["containers"][0]["args"] if a.startswith("--config-file=")]
    path = Path(config_arg.split("=", 1)[1].split()[0])
    [mount] = [m for m in picker["containers"][0]["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    [volume] = [v for v in picker["volumes"] if v["name"] == mount["name"]]
    config = yaml.safe_load(rendered[f"ConfigMap/{volume['configMap']['name']}"]["data"][path.name])
    assert config["apiVersion"] == "llm-d.ai/v1alpha1" and config["kind"] == "EndpointPickerConfig"
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics/model-server"
    assert config["dataLayer"]["sources"] == [{"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]}]
    [profile] = config["schedulingProfiles"]
    refs = {p["pluginRef"]: p.get("weight", 1) for p in profile["plugins"]}
    assert set(refs) <= set(plugins) and "max-score-picker" in refs
    # The scorer gives awake 1.0 and room 0.8; every other scorer gives 0..1. Awake must win whatever
    # the others say: 0.2 of the lora weight above the sum of theirs.
    others = sum(w for ref, w in refs.items() if ref.endswith("-scorer") and ref != "lora-affinity-scorer")
    assert 0.2 * refs["lora-affinity-scorer"] > others


def test_each_pod_serves_the_same_models_one_awake_at_a_time_and_its_scrape_is_open(rendered):
    roster_cm = next(d for d in rendered.values() if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("hotswap-rosters"))
    container = rendered["StatefulSet/hotswap"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"] for e in container["env"]}
    served = []
    for name, text in sorted(roster_cm["data"].items()):
        referenced = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
        assert referenced <= env
        roster = parse_roster(text, name, {v: f"x-{v}" for v in referenced})
        served.append(sorted(n for m in roster.models for n in m.names))
        # The picker sends no key: with client keys, the scrape must be open.
        assert roster.auth.open_metrics
        assert most_awake([SimpleNamespace(name=m.name, spec=m) for m in roster.models], Capacity(None, 0.0)) == 1
    assert len(served) == rendered["StatefulSet/hotswap"]["spec"]["replicas"] and all(s == served[0] for s in served)


def test_only_the_picker_the_gateway_and_prometheus_reach_the_pods(rendered):
    policy = only(rendered, "NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= rendered["StatefulSet/hotswap"]["spec"]["template"]["metadata"]["labels"].items()
    [rule] = policy["ingress"]
    picker_labels = rendered["Deployment/hotswap-picker"]["spec"]["template"]["metadata"]["labels"]
    assert any(p.get("podSelector", {}).get("matchLabels", {}).items() <= picker_labels.items() and "podSelector" in p
               for p in rule["from"])
    assert len(rule["from"]) == 3
