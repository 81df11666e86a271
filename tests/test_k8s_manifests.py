"""The Kubernetes manifests stay in step with the CLI and the HTTP routes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import yaml

from common.cli import build_parser
from common.config import server_args_from_namespace
from common.server.http_app import create_app

K8S = Path(__file__).resolve().parent.parent / "k8s"


def documents():
    for path in sorted(K8S.glob("*.yaml")):
        yield from (d for d in yaml.safe_load_all(path.read_text()) if d)


WORKLOADS = ("Deployment", "StatefulSet")


def containers():
    for doc in documents():
        if doc["kind"] in WORKLOADS:
            yield from doc["spec"]["template"]["spec"]["containers"]


def service_containers():
    """Containers running a pdserve service (serve, prefill, decode), not the router."""
    return [c for c in containers() if c["args"][0] != "router"]


def router_containers():
    return [c for c in containers() if c["args"][0] == "router"]


def test_manifests_exist_and_parse():
    kinds = [d["kind"] for d in documents()]
    assert "Deployment" in kinds and "Service" in kinds


def test_container_args_are_valid_pdserve_flags():
    for container in service_containers():
        assert container["command"] == ["pdserve"]
        ns = build_parser().parse_args(container["args"])
        args = server_args_from_namespace(ns)
        assert args.port == container["ports"][0]["containerPort"]
        assert args.host == "0.0.0.0"
        assert args.disaggregation_mode == {"serve": "null"}.get(ns.command, ns.command)
        if args.disaggregation_mode == "prefill":
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["bootstrap"] == args.disaggregation_bootstrap_port


def test_router_points_at_the_pd_pods():
    from router.config import router_args_from_namespace

    docs = list(documents())
    stateful = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    routers = router_containers()
    assert routers
    for container in routers:
        args = router_args_from_namespace(build_parser().parse_args(container["args"]))
        assert args.port == container["ports"][0]["containerPort"]
        assert args.host == "0.0.0.0" and args.pd_disaggregation
        for url in [p.url for p in args.prefill] + list(args.decode):
            # http://<statefulset>-<ordinal>.<headless service>:<port>
            host, port = url.removeprefix("http://").split(":")
            pod, service = host.split(".")
            name, _, ordinal = pod.rpartition("-")
            workload = stateful[name]
            assert workload["spec"]["serviceName"] == service
            assert int(ordinal) < workload["spec"]["replicas"]
            container_ports = [p["containerPort"] for c in
                               workload["spec"]["template"]["spec"]["containers"]
                               for p in c["ports"]]
            assert int(port) in container_ports
        for spec in args.prefill:
            workload = stateful[spec.url.removeprefix("http://").split(".")[0].rpartition("-")[0]]
            prefill_args = workload["spec"]["template"]["spec"]["containers"][0]["args"]
            assert prefill_args[0] == "prefill"
            assert spec.bootstrap_port == server_args_from_namespace(
                build_parser().parse_args(prefill_args)).disaggregation_bootstrap_port


def create_router_app_for_test():
    from router.app import create_app as create_router_app

    return create_router_app(SimpleNamespace(args=SimpleNamespace(max_payload_size=1 << 20)))


def test_probes_use_real_routes():
    app = create_app(SimpleNamespace())
    routes = {r.resource.canonical for r in app.router.routes() if r.method == "GET"}
    for container in service_containers():
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"]["path"] in routes
    router_routes = {r.resource.canonical for r in create_router_app_for_test().router.routes()
                     if r.method == "GET"}
    for container in router_containers():
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"]["path"] in router_routes


def test_service_targets_the_deployment():
    docs = list(documents())
    services = [d for d in docs if d["kind"] == "Service"]
    deployments = [d for d in docs if d["kind"] in WORKLOADS]
    for svc in services:
        selector = svc["spec"]["selector"]
        assert any(
            selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
            for d in deployments
        )
