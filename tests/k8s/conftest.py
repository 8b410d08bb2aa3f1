"""Fixtures for the Kubernetes manifest tests: each overlay rendered once by `kubectl kustomize`."""

from __future__ import annotations

import copy

import pytest

from tests.k8s.manifests import K8S, OVERLAYS, render, render_with_components


@pytest.fixture(scope="session")
def _rendered_once() -> dict[str, list[dict]]:
    out = {ov: render(K8S / "overlays" / ov) for ov in OVERLAYS}
    out["gpu+external-redis"] = render_with_components(K8S / "overlays" / "gpu", [K8S / "components" / "external-redis"])
    out["gpu+tls"] = render_with_components(K8S / "overlays" / "gpu", [K8S / "components" / "tls"])
    return out


@pytest.fixture
def rendered(_rendered_once) -> dict[str, list[dict]]:
    """overlay name -> rendered objects (a fresh copy per test, so a test may edit them); also
    "gpu+external-redis" (the managed-Redis switch) and "gpu+tls" (TLS, mutual TLS and tokens)."""
    return copy.deepcopy(_rendered_once)
