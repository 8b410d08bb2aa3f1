"""The overlays render with kubectl kustomize and validate offline against the Kubernetes schemas
(kubernetes-validate, strict: unknown fields are errors)."""

from __future__ import annotations

import base64
import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as kv

from tests.k8s.manifests import K8S, OVERLAYS, SCHEMA_VERSION, find_kubectl, kind, name, pod_spec

VARIANTS = (*OVERLAYS, "gpu+external-redis", "gpu+tls")


def schema_errors(objs: list[dict]) -> list[str]:
    """Strict schema errors; an object whose kind has no schema counts as an error too
    (kubernetes-validate's CLI only warns about those)."""
    errors = []
    for o in objs:
        try:
            kv.validate(o, SCHEMA_VERSION, strict=True)
        except kv.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(f"{o['kind']} {name(o)}: {path}: {exc.message}")
        except kv.SchemaNotFoundError:
            errors.append(f"{o['kind']} {name(o)}: no schema for {o['apiVersion']} {o['kind']} in {SCHEMA_VERSION}")
    return errors


def deployment(objs, n):
    return next(d for d in kind(objs, "Deployment") if name(d) == n)


def test_kubectl_has_kustomize_v5():
    out = subprocess.run([find_kubectl(), "version", "--client"], capture_output=True, text=True, check=True)
    assert "Kustomize Version: v5" in out.stdout, out.stdout


@pytest.mark.parametrize("overlay", VARIANTS)
def test_overlay_renders_the_three_roles(rendered, overlay):
    names = {name(d) for d in kind(rendered[overlay], "Deployment")}
    assert names == {"specdec-draft", "specdec-target", "specdec-coordinator"}
    assert {o["metadata"].get("namespace") for o in rendered[overlay] if o["kind"] != "Namespace"} == {"specdec"}


@pytest.mark.parametrize("overlay", VARIANTS)
def test_overlay_validates_strictly_against_the_schemas(rendered, overlay):
    assert schema_errors(rendered[overlay]) == []


def test_kubernetes_validate_cli_passes_both_overlays(rendered, tmp_path):
    files = []
    for overlay in OVERLAYS:
        f = tmp_path / f"{overlay}.yaml"
        f.write_text(yaml.safe_dump_all(rendered[overlay]))
        files.append(str(f))
    cli = Path(sys.executable).parent / "kubernetes-validate"
    out = subprocess.run([str(cli), "--strict", "-k", SCHEMA_VERSION, "--quiet", *files],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "ERROR" not in out.stdout and "WARN" not in out.stdout, out.stdout + out.stderr


def test_schema_validation_rejects_a_misspelled_field(rendered):
    objs = copy.deepcopy([o for o in rendered["cpu"] if o["kind"] == "Deployment"][:1])
    c = pod_spec(objs[0])["containers"][0]
    c["readinesProbe"] = c.pop("readinessProbe")
    assert any("readinesProbe" in e for e in schema_errors(objs))


def test_schema_validation_rejects_an_unknown_kind():
    obj = {"apiVersion": "apps/v1", "kind": "Deploymnet", "metadata": {"name": "x"}}
    assert schema_errors([obj]) != []


def test_gpu_overlay_scales_draft_and_target_differently(rendered):
    hpas = {name(h): h["spec"] for h in kind(rendered["gpu"], "HorizontalPodAutoscaler")}
    draft, target = hpas["specdec-draft"], hpas["specdec-target"]
    assert (draft["minReplicas"], draft["maxReplicas"]) != (target["minReplicas"], target["maxReplicas"])
    assert target["minReplicas"] > draft["minReplicas"]


def test_gpu_overlay_puts_draft_and_target_on_gpus_with_a_model_volume(rendered):
    objs = rendered["gpu"]
    for n, flag in (("specdec-draft", "--draft"), ("specdec-target", "--target")):
        spec = pod_spec(deployment(objs, n))
        c = spec["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        model_dir = c["args"][c["args"].index(flag) + 1]
        mount = next(p for p in mounts if model_dir.startswith(p.rstrip("/") + "/"))
        volume = next(v for v in spec["volumes"] if v["name"] == mounts[mount])
        claim = volume["persistentVolumeClaim"]["claimName"]
        assert claim in {name(p) for p in kind(objs, "PersistentVolumeClaim")}
        # a GPU requested and then not used would be the worst of both: the model must be put on it
        assert c["args"][c["args"].index("--device") + 1] == "cuda"
    coordinator = pod_spec(deployment(objs, "specdec-coordinator"))["containers"][0]
    assert "nvidia.com/gpu" not in coordinator["resources"]["limits"]


def test_cpu_overlay_needs_no_gpu_and_no_model_volume(rendered):
    objs = rendered["cpu"]
    assert not kind(objs, "PersistentVolumeClaim")
    for d in kind(objs, "Deployment"):
        c = pod_spec(d)["containers"][0]
        assert not any("/" in r for r in c["resources"]["limits"]), name(d)
        assert "--draft" not in c["args"] and "--target" not in c["args"]  # the embedded default


def test_external_redis_component_removes_the_in_cluster_redis(rendered):
    objs = rendered["gpu+external-redis"]
    assert not kind(objs, "StatefulSet")
    assert "specdec-redis" not in {name(s) for s in kind(objs, "Service")}
    [secret] = kind(objs, "Secret")
    url = base64.b64decode(secret["data"]["url"]).decode()
    env_file = (K8S / "components" / "external-redis" / "redis.env").read_text()
    assert f"url={url}" in env_file.splitlines()


def test_the_deployment_docs_name_files_that_exist_and_the_manifests_replica_ranges(rendered):
    section = (K8S.parent / "docs" / "deployment.md").read_text()
    links = [p.removeprefix("../") for p in re.findall(r"\]\(((?:\.\./)?(?:k8s/|Dockerfile)[^)]*)\)", section)]
    for path in links + re.findall(r"`(k8s/[\w./-]+)`", section):
        assert (K8S.parent / path.split("{")[0]).exists(), path
    hpas = {name(h): h["spec"] for h in kind(rendered["gpu"], "HorizontalPodAutoscaler")}
    d, t = hpas["specdec-draft"], hpas["specdec-target"]
    assert f"{d['minReplicas']}-{d['maxReplicas']} draft pods, {t['minReplicas']}-{t['maxReplicas']} target pods" \
        in section
    grace = {pod_spec(w)["terminationGracePeriodSeconds"] for w in kind(rendered["gpu"], "Deployment")}
    assert grace == {int(re.search(r"`terminationGracePeriodSeconds` is (\d+)", section).group(1))}
    assert f"Kubernetes {SCHEMA_VERSION.rsplit('.', 1)[0]}" in section


def test_tls_component_mounts_certificates_and_tokens_from_secrets_and_moves_probes(rendered):
    objs = rendered["gpu+tls"]
    secrets = {}
    for d in kind(objs, "Deployment"):
        spec = pod_spec(d)
        c = spec["containers"][0]
        args = c["args"]
        assert "--insecure" not in args, name(d)
        assert args[args.index("--tls-cert") + 1].startswith("/etc/specdec-tls/"), name(d)
        secrets[name(d)] = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        health = args[args.index("--health-port") + 1]
        assert {c[p]["grpc"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {int(health)}
    assert secrets == {"specdec-draft": {"specdec-draft-tls"}, "specdec-target": {"specdec-target-tls"},
                       "specdec-coordinator": {"specdec-coordinator-tls", "specdec-tokens"}}
    for n in ("specdec-draft", "specdec-target"):
        assert "--tls-client-ca" in pod_spec(deployment(objs, n))["containers"][0]["args"]
    coord = pod_spec(deployment(objs, "specdec-coordinator"))["containers"][0]["args"]
    for flag in ("--upstream-ca", "--upstream-cert", "--upstream-key", "--upstream-server-name", "--token-file"):
        assert flag in coord
    # The names the coordinator checks are the names cert-manager's example certificates carry.
    example = list(yaml.safe_load_all((K8S / "components" / "tls" / "cert-manager.example.yaml").read_text()))
    certs = {c["spec"]["secretName"]: c["spec"] for c in example if c["kind"] == "Certificate"}
    server_name = coord[coord.index("--upstream-server-name") + 1]
    assert all(server_name in certs[f"specdec-{r}-tls"]["dnsNames"] for r in ("draft", "target"))
    assert "client auth" in certs["specdec-coordinator-tls"]["usages"]
