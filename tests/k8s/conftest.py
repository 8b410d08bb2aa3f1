"""Fixtures for the Kubernetes manifest tests: each overlay rendered once by `kubectl kustomize`."""

from __future__ import annotations

import pytest

from tests.k8s.manifests import K8S, OVERLAYS, render, render_with_components


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """overlay name -> rendered objects; also "gpu+external-redis" (the managed-Redis switch)."""
    out = {ov: render(K8S / "overlays" / ov) for ov in OVERLAYS}
    out["gpu+external-redis"] = render_with_components(K8S / "overlays" / "gpu", [K8S / "components" / "external-redis"])
    return out
