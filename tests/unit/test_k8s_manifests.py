"""The Kubernetes manifests (deploy/k8s), rendered for each topology with kustomize and
validated offline against the Kubernetes schemas: every role has probes, resource requests
and a disruption budget; every Service the gateway's `dns:` entries and the workers' service
addresses name exists with that port; every autoscaler scales a Deployment on a metric
that the Deployment's own service exports, through the prometheus-adapter rules shipped;
Prometheus scrapes private ports only; and the Mooncake overlay's pool (master, store nodes)
is the one its workers and gateway name; the Grafana dashboards ship as a sidecar's ConfigMap."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from deploy.grafana import render as grafana
from deploy.mooncake import Master
from services.gateway import metrics as gateway_metrics
from services.kvcache import mooncake_node, mooncake_pool
from services.worker import metrics as worker_metrics

K8S = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "k8s")
TOPOLOGIES = ("colocated", "1p1d", "3p1d", "1p1d-mooncake")
REGISTRIES = {
    "services.gateway": gateway_metrics.REGISTRY,
    "services.worker": worker_metrics.REGISTRY,
    "services.prefill": worker_metrics.REGISTRY,
    "services.decode": worker_metrics.REGISTRY,
}


def kustomize(folder: str) -> str:
    if shutil.which("kustomize"):
        command = ["kustomize", "build", folder]
    elif shutil.which("kubectl"):
        command = ["kubectl", "kustomize", folder]
    else:
        pytest.skip("neither kustomize nor kubectl is installed to render deploy/k8s")
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module", params=TOPOLOGIES)
def manifests(request) -> dict[tuple[str, str], dict]:
    docs = [
        d for d in yaml.safe_load_all(kustomize(os.path.join(K8S, "overlays", request.param))) if d
    ]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def of_kind(manifests, kind: str) -> dict[str, dict]:
    return {name: doc for (k, name), doc in manifests.items() if k == kind}


def env_of(manifests, deployment: dict) -> dict[str, str]:
    """A Deployment's container environment: its ConfigMaps' data, then its own values."""
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    env = {}
    for source in container.get("envFrom", []):
        env.update(manifests[("ConfigMap", source["configMapRef"]["name"])].get("data", {}))
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def test_every_manifest_validates_against_the_kubernetes_schemas(manifests):
    version = latest_version()
    for doc in manifests.values():
        kubernetes_validate.validate(doc, version, strict=True)  # raises, naming the field, if not


def test_every_role_has_probes_requests_a_budget_and_the_image(manifests):
    budgets = of_kind(manifests, "PodDisruptionBudget")
    roles = of_kind(manifests, "Deployment")
    assert {"envoy", "gateway", "draft"} <= set(roles)
    assert {"kvcache"} <= set(roles) or {"mooncake-master", "mooncake-node"} <= set(roles)
    assert {"worker"} <= set(roles) or {"prefill", "decode"} <= set(roles)
    for name, deployment in roles.items():
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert container["readinessProbe"] and container["livenessProbe"], name
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
        assert container["image"] == "tandem:latest", name
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert any(
            b["spec"]["selector"]["matchLabels"].items() <= labels.items() for b in budgets.values()
        ), name


def test_every_service_the_gateway_and_workers_name_exists_with_its_port(manifests):
    services_ = of_kind(manifests, "Service")
    gateway = env_of(manifests, manifests[("Deployment", "gateway")])
    entries = [
        e
        for key in ("TANDEM_WORKERS", "TANDEM_PREFILL_WORKERS", "TANDEM_DECODE_WORKERS")
        for e in gateway.get(key, "").split(",")
        if e
    ]
    assert entries, "the gateway names no workers"
    for entry in entries:
        kind, name, port = entry.split(":")
        assert kind == "dns" and name in services_, entry
        service = services_[name]
        assert service["spec"].get("clusterIP") == "None", (
            f"{name}: headless, so DNS names every worker"
        )
        assert int(port) in [p["port"] for p in service["spec"]["ports"]], entry
        target = manifests[("Deployment", name)]["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= target.items(), entry
    for deployment in of_kind(manifests, "Deployment").values():
        env = env_of(manifests, deployment)
        for key in ("TANDEM_KV_STORE", "TANDEM_DRAFT"):
            if key not in env:
                continue
            if env[key].startswith(mooncake_pool.SCHEME):  # the master's RPC and metadata server
                master, metadata = mooncake_pool.parse_address(env[key])
                addresses = [master, urlparse(metadata).netloc]
            else:
                addresses = [env[key]]
            for address in addresses:
                host, port = address.split(":")
                assert int(port) in [p["port"] for p in services_[host]["spec"]["ports"]], (
                    key,
                    env[key],
                )


def test_autoscalers_scale_on_metrics_their_services_export(manifests):
    rules = yaml.safe_load(
        manifests[("ConfigMap", "tandem-prometheus-adapter-rules")]["data"]["config.yaml"]
    )["rules"]
    served = re.compile(re.search(r'__name__=~"([^"]+)"', rules[0]["seriesQuery"]).group(1))
    autoscalers = of_kind(manifests, "HorizontalPodAutoscaler")
    worker_roles = {"worker"} if ("Deployment", "worker") in manifests else {"prefill", "decode"}
    assert {"envoy", "gateway", "draft"} | worker_roles <= set(autoscalers)
    for name, hpa in autoscalers.items():
        target = manifests[("Deployment", hpa["spec"]["scaleTargetRef"]["name"])]
        [container] = target["spec"]["template"]["spec"]["containers"]
        module = container["command"][2]  # python -m MODULE
        exported = {m.name for m in REGISTRIES[module].collect()} if module in REGISTRIES else set()
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Resource":
                continue
            assert metric["type"] == "Pods", name
            series = re.sub(r"^tandem_", "tandem:", metric["pods"]["metric"]["name"])
            assert series in exported, f"{name} scales on {series}, which {module} does not export"
            assert served.fullmatch(series), f"the adapter rules do not serve {series}"
    own_load = {
        "prefill": "tandem_num_prompt_tokens_pending",
        "decode": "tandem_num_decode_tokens_running",
    }
    for role, metric in own_load.items():
        if role in autoscalers:
            assert [m["pods"]["metric"]["name"] for m in autoscalers[role]["spec"]["metrics"]] == [
                metric
            ]


def test_prometheus_scrapes_the_private_ports_never_envoys_public_one(manifests):
    """The gateway's page answers without a key only on its own HTTP port, which no public
    Service exposes; Envoy's public port wants a key with the metrics scope when keys are on."""
    deployments = of_kind(manifests, "Deployment")
    public = [
        s
        for s in of_kind(manifests, "Service").values()
        if s["spec"].get("type") in ("LoadBalancer", "NodePort")
    ]
    assert public, "no public Service: Envoy's"
    scraped = {}
    for name, deployment in deployments.items():
        template = deployment["spec"]["template"]
        annotations = template["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") != "true":
            continue
        port = int(annotations["prometheus.io/port"])
        [container] = template["spec"]["containers"]
        assert port in [p["containerPort"] for p in container["ports"]], name
        for service in public:
            if service["spec"]["selector"].items() <= template["metadata"]["labels"].items():
                targets = [p["targetPort"] for p in service["spec"]["ports"]]
                assert port not in targets, f"{name} is scraped on a public port"
        scraped[name] = port
    assert "envoy" not in scraped and "gateway" in scraped
    [envoy] = deployments["envoy"]["spec"]["template"]["spec"]["containers"]
    gateway_http = envoy["args"][envoy["args"].index("--gateway-http") + 1]
    assert gateway_http == f"gateway:{scraped['gateway']}"  # the page Envoy serves publicly


def test_the_larger_ratio_topology_starts_three_prefill_workers_per_decode_worker():
    docs = {
        (d["kind"], d["metadata"]["name"]): d
        for d in yaml.safe_load_all(kustomize(os.path.join(K8S, "overlays", "3p1d")))
    }
    assert docs[("Deployment", "prefill")]["spec"]["replicas"] == 3
    assert docs[("Deployment", "decode")]["spec"]["replicas"] == 1
    assert docs[("HorizontalPodAutoscaler", "prefill")]["spec"]["minReplicas"] == 3


def test_the_mooncake_overlay_runs_one_pool_its_workers_and_gateway_use(monkeypatch):
    docs = {
        (d["kind"], d["metadata"]["name"]): d
        for d in yaml.safe_load_all(kustomize(os.path.join(K8S, "overlays", "1p1d-mooncake")))
    }
    assert ("Deployment", "kvcache") not in docs and ("Service", "kvcache") not in docs
    pool = docs[("ConfigMap", "tandem-config")]["data"]["TANDEM_KV_STORE"]
    master, metadata = mooncake_pool.parse_address(pool)
    for role in ("prefill", "decode", "gateway"):
        assert env_of(docs, docs[("Deployment", role)])["TANDEM_KV_STORE"] == pool, role
    for role in ("prefill", "decode"):
        assert env_of(docs, docs[("Deployment", role)])["TANDEM_KV_TRANSPORT"] == "mooncake"
    # the master listens where they look, with flags deploy/mooncake.py runs it with
    [container] = docs[("Deployment", "mooncake-master")]["spec"]["template"]["spec"]["containers"]
    flags = dict(a.split("=", 1) for a in container["args"])
    assert set(flags) <= {a.split("=", 1)[0] for a in Master("h", 1, 2, 3).argv()[1:]}
    assert master == f"mooncake-master:{flags['--rpc_port']}"
    assert urlparse(metadata).netloc == f"mooncake-master:{flags['--http_metadata_server_port']}"
    # the store nodes join that pool, with arguments the node takes
    node = docs[("Deployment", "mooncake-node")]
    [container] = node["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(POD_IP)", "10.0.0.7") for a in container["args"]]
    monkeypatch.setattr(sys, "argv", ["mooncake_node", *args])
    parsed = mooncake_node.parse_args()
    assert (parsed.host, parsed.master, parsed.metadata) == ("10.0.0.7", master, metadata)
    assert container["readinessProbe"]["exec"]["command"][-1] == parsed.ready_file
    # nodes scale out on their load, and in one at a time, slowly: a removed node's blocks are lost
    hpa = docs[("HorizontalPodAutoscaler", "mooncake-node")]
    assert hpa["spec"]["minReplicas"] == node["spec"]["replicas"] == 2
    [policy] = hpa["spec"]["behavior"]["scaleDown"]["policies"]
    assert policy == {"type": "Pods", "value": 1, "periodSeconds": 600}


def test_the_grafana_dashboards_ship_as_a_configmap_for_grafanas_sidecar(manifests):
    """deploy/grafana's dashboards, whole, in a ConfigMap Grafana's dashboard sidecar picks up."""
    configmap = manifests[("ConfigMap", "tandem-grafana-dashboards")]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    for name in grafana.DASHBOARDS:
        with open(os.path.join(grafana.HERE, name)) as f:
            assert json.loads(configmap["data"][name]) == json.load(f), name
