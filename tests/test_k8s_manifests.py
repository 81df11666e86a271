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


def containers():
    for doc in documents():
        if doc["kind"] == "Deployment":
            yield from doc["spec"]["template"]["spec"]["containers"]


def test_manifests_exist_and_parse():
    kinds = [d["kind"] for d in documents()]
    assert "Deployment" in kinds and "Service" in kinds


def test_container_args_are_valid_pdserve_flags():
    for container in containers():
        assert container["command"] == ["pdserve"]
        ns = build_parser().parse_args(container["args"])
        args = server_args_from_namespace(ns)
        assert args.port == container["ports"][0]["containerPort"]
        assert args.host == "0.0.0.0"


def test_probes_use_real_routes():
    app = create_app(SimpleNamespace())
    routes = {r.resource.canonical for r in app.router.routes() if r.method == "GET"}
    for container in containers():
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"]["path"] in routes


def test_service_targets_the_deployment():
    docs = list(documents())
    services = [d for d in docs if d["kind"] == "Service"]
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    for svc in services:
        selector = svc["spec"]["selector"]
        assert any(
            selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
            for d in deployments
        )
