"""The manifests fit the services' code (tests/k8s/manifests.py), and each check catches the
mistake it exists for: every test below breaks one thing on purpose in a copy of the rendered
objects and asserts the checker names it."""

from __future__ import annotations

import base64

import pytest

import draft_service.__main__ as draft_main
from tests.k8s import manifests as m
from tests.k8s.manifests import all_problems, kind, mutated, name, pod_spec

VARIANTS = (*m.OVERLAYS, "gpu+external-redis", "gpu+tls")


def obj(objs, k, n):
    return next(o for o in kind(objs, k) if name(o) == n)


def container(objs, deployment):
    return pod_spec(obj(objs, "Deployment", deployment))["containers"][0]


def set_arg(c, flag, value):
    args = c["args"]
    args[args.index(flag) + 1] = value


def problems_after(objs, edit):
    return all_problems(mutated(objs, edit))


def assert_reported(problems, *needles):
    assert any(all(n in p for n in needles) for p in problems), "\n".join(problems) or "no problems reported"


@pytest.fixture
def cpu(rendered):
    return rendered["cpu"]


@pytest.mark.parametrize("overlay", VARIANTS)
def test_overlay_passes_every_semantic_check(rendered, overlay):
    assert all_problems(rendered[overlay]) == []


def test_every_role_runs_with_the_settings_its_parser_accepts(cpu):
    running, problems = m.running_roles(cpu)
    assert problems == []
    assert {r.role.module for r in running} == {"draft_service", "target_service", "coordinator"}
    coordinator = next(r for r in running if r.role.module == "coordinator")
    assert coordinator.settings.redis_url == "redis://specdec-redis:6379/0"  # from the Secret, via $(REDIS_URL)
    assert coordinator.settings.discovery == "kubernetes"


# --- selectors -----------------------------------------------------------------------------------

def test_service_selecting_no_pods_is_reported(cpu):
    def edit(objs):
        obj(objs, "Service", "specdec-draft")["spec"]["selector"]["app.kubernetes.io/component"] = "drafts"
    problems = problems_after(cpu, edit)
    assert_reported(problems, "Service specdec-draft", "selects the pods of 0 workloads")


def test_deployment_selector_not_matching_its_pods_is_reported(cpu):
    def edit(objs):
        obj(objs, "Deployment", "specdec-target")["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "x"
    assert_reported(problems_after(cpu, edit), "Deployment specdec-target", "does not match its pod template")


def test_service_selecting_two_roles_is_reported(cpu):
    def edit(objs):
        del obj(objs, "Service", "specdec-target")["spec"]["selector"]["app.kubernetes.io/component"]
    assert_reported(problems_after(cpu, edit), "Service specdec-target", "expected exactly one")


def test_pod_label_change_breaks_the_network_policy_and_pdb(cpu):
    def edit(objs):
        d = obj(objs, "Deployment", "specdec-draft")
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] = "drafter"
        d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "drafter"
        for t in d["spec"]["template"]["spec"]["topologySpreadConstraints"]:
            t["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] = "drafter"
    problems = problems_after(cpu, edit)
    assert_reported(problems, "PodDisruptionBudget specdec-draft", "selects no pods")
    assert_reported(problems, "NetworkPolicy specdec-draft", "selects no pods")
    assert_reported(problems, "Deployment specdec-draft", "0 PodDisruptionBudgets")


# --- ports ---------------------------------------------------------------------------------------

def test_container_port_differing_from_the_port_flag_is_reported(cpu):
    def edit(objs):
        container(objs, "specdec-target")["ports"][0]["containerPort"] = 50099
    assert_reported(problems_after(cpu, edit), "specdec-target", "containerPort grpc is 50099", "listens on 50062")


def test_http_port_flag_differing_from_the_coordinators_http_container_port_is_reported(cpu):
    def edit(objs):
        set_arg(container(objs, "specdec-coordinator"), "--http-port", "8080")
    assert_reported(problems_after(cpu, edit), "specdec-coordinator", "containerPort http is 8000", "listens on 8080")


def test_port_flag_changed_alone_is_reported_at_every_port_that_follows_it(cpu):
    def edit(objs):
        set_arg(container(objs, "specdec-draft"), "--port", "50070")
    problems = problems_after(cpu, edit)
    assert_reported(problems, "specdec-draft", "containerPort grpc is 50061", "listens on 50070")
    assert_reported(problems, "specdec-draft", "readinessProbe checks gRPC port 50061")


def test_metrics_annotation_differing_from_metrics_port_is_reported(cpu):
    def edit(objs):
        obj(objs, "Deployment", "specdec-coordinator")["spec"]["template"]["metadata"]["annotations"][
            "prometheus.io/port"] = "9999"
    assert_reported(problems_after(cpu, edit), "prometheus.io/port is 9999")


def test_port_checks_follow_the_role_parser_defaults(cpu, monkeypatch):
    """With --port left out, the port is the parser's default: the check reads it from the code."""
    def edit(objs):
        args = container(objs, "specdec-draft")["args"]
        i = args.index("--port")
        del args[i:i + 2]
    assert all_problems(mutated(cpu, edit)) == []  # the default (50061) is what the manifests say

    real = draft_main.build_parser

    def moved_default():
        p = real()
        p.set_defaults(port=50071)
        return p
    monkeypatch.setattr(draft_main, "build_parser", moved_default)
    assert_reported(all_problems(mutated(cpu, edit)), "specdec-draft", "listens on 50071")


# --- probes --------------------------------------------------------------------------------------

def test_missing_readiness_probe_is_reported(cpu):
    def edit(objs):
        del container(objs, "specdec-target")["readinessProbe"]
    assert_reported(problems_after(cpu, edit), "specdec-target", "no readinessProbe")


def test_probe_on_the_wrong_port_is_reported(cpu):
    def edit(objs):
        container(objs, "specdec-coordinator")["livenessProbe"]["grpc"]["port"] = 50061
    assert_reported(problems_after(cpu, edit), "specdec-coordinator", "livenessProbe checks gRPC port 50061")


def test_probe_asking_for_another_service_health_is_reported(cpu):
    def edit(objs):
        container(objs, "specdec-draft")["readinessProbe"]["grpc"]["service"] = "specdec.rpc.v1.TargetService"
    assert_reported(problems_after(cpu, edit), "specdec-draft", "readinessProbe asks health for")


def test_http_probe_instead_of_grpc_is_reported(cpu):
    def edit(objs):
        container(objs, "specdec-draft")["livenessProbe"] = {"tcpSocket": {"port": 50061}}
    assert_reported(problems_after(cpu, edit), "livenessProbe is not a gRPC health probe")


def test_startup_probe_too_short_for_model_loading_is_reported(cpu):
    def edit(objs):
        container(objs, "specdec-target")["startupProbe"]["failureThreshold"] = 3
    assert_reported(problems_after(cpu, edit), "specdec-target", "startupProbe gives model loading 15 s")


# --- arguments and settings ----------------------------------------------------------------------

def test_unknown_flag_is_reported(cpu):
    def edit(objs):
        container(objs, "specdec-target")["args"] += ["--max-batch-size", "8"]
    assert_reported(problems_after(cpu, edit), "python -m target_service", "rejects its arguments",
                    "--max-batch-size")


def test_unknown_config_key_is_reported(cpu):
    def edit(objs):
        [cm] = kind(objs, "ConfigMap")
        cm["data"]["draft.toml"] += "max_session = 3\n"
    assert_reported(problems_after(cpu, edit), "python -m draft_service", "unknown settings", "max_session")


def test_config_file_read_by_no_role_is_reported(cpu):
    def edit(objs):
        [cm] = kind(objs, "ConfigMap")
        cm["data"]["medusa.toml"] = "heads = 4\n"
    assert_reported(problems_after(cpu, edit), "key medusa.toml is read by no role")


def test_module_that_is_not_a_role_is_reported(cpu):
    def edit(objs):
        container(objs, "specdec-draft")["command"] = ["python", "-m", "draft_server"]
    assert_reported(problems_after(cpu, edit), "python -m draft_server", "not a service of this project")


def test_short_termination_grace_is_reported(cpu):
    def edit(objs):
        pod_spec(obj(objs, "Deployment", "specdec-target"))["terminationGracePeriodSeconds"] = 20
    assert_reported(problems_after(cpu, edit), "specdec-target", "terminationGracePeriodSeconds 20", "drain gets killed")


def test_grace_period_raised_in_the_config_alone_is_reported(cpu):
    def edit(objs):
        [cm] = kind(objs, "ConfigMap")
        cm["data"]["coordinator.toml"] = cm["data"]["coordinator.toml"].replace("grace_period = 25.0",
                                                                                  "grace_period = 60.0")
    assert_reported(problems_after(cpu, edit), "specdec-coordinator", "--grace-period 60 s")


# --- resources, PDBs, security -------------------------------------------------------------------

def test_missing_memory_limit_is_reported(cpu):
    def edit(objs):
        del container(objs, "specdec-draft")["resources"]["limits"]["memory"]
    assert_reported(problems_after(cpu, edit), "specdec-draft", "requests and limits for memory")


def test_missing_pdb_is_reported(cpu):
    def edit(objs):
        objs[:] = [o for o in objs if not (o["kind"] == "PodDisruptionBudget" and name(o) == "specdec-coordinator")]
    assert_reported(problems_after(cpu, edit), "Deployment specdec-coordinator", "0 PodDisruptionBudgets")


def test_root_container_is_reported(cpu):
    def edit(objs):
        pod_spec(obj(objs, "Deployment", "specdec-target"))["securityContext"]["runAsNonRoot"] = False
    assert_reported(problems_after(cpu, edit), "specdec-target", "non-root")


# --- autoscaling ---------------------------------------------------------------------------------

def test_hpa_on_a_missing_deployment_is_reported(cpu):
    def edit(objs):
        obj(objs, "HorizontalPodAutoscaler", "specdec-draft")["spec"]["scaleTargetRef"]["name"] = "specdec-drafts"
    assert_reported(problems_after(cpu, edit), "specdec-drafts does not exist")


def test_hpa_metric_without_an_adapter_rule_is_reported(cpu):
    def edit(objs):
        obj(objs, "HorizontalPodAutoscaler", "specdec-target")["spec"]["metrics"][0]["pods"]["metric"][
            "name"] = "specdec_inflight_requests"
    assert_reported(problems_after(cpu, edit), "specdec_inflight_requests is produced by no rule")


def test_adapter_rules_read_a_series_the_services_export():
    provided = m.adapter_metrics()
    assert provided and set(provided.values()) <= m.exported_series()


def test_cpu_based_hpa_is_reported(cpu):
    def edit(objs):
        obj(objs, "HorizontalPodAutoscaler", "specdec-target")["spec"]["metrics"] = [
            {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}]
    assert_reported(problems_after(cpu, edit), "scales on cpu")


def test_fixed_replicas_under_an_hpa_are_reported(cpu):
    def edit(objs):
        obj(objs, "Deployment", "specdec-draft")["spec"]["replicas"] = 2
    assert_reported(problems_after(cpu, edit), "specdec-draft", "sets spec.replicas")


# --- discovery, RBAC, Redis ----------------------------------------------------------------------

def test_discovery_of_a_service_that_does_not_exist_is_reported(cpu):
    def edit(objs):
        set_arg(container(objs, "specdec-coordinator"), "--target-service", "target")
    assert_reported(problems_after(cpu, edit), "--target-service target names no Service")


def test_service_port_renamed_away_from_what_the_watcher_reads_is_reported(cpu):
    def edit(objs):
        obj(objs, "Service", "specdec-draft")["spec"]["ports"][0]["name"] = "rpc"
    assert_reported(problems_after(cpu, edit), "Service specdec-draft", f"no port named {m.watcher_port_name()!r}")


def test_non_headless_discovery_service_is_reported(cpu):
    def edit(objs):
        del obj(objs, "Service", "specdec-target")["spec"]["clusterIP"]
    assert_reported(problems_after(cpu, edit), "Service specdec-target", "headless")


def test_broader_rbac_is_reported(cpu):
    def edit(objs):
        [role] = kind(objs, "Role")
        role["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})
    assert_reported(problems_after(cpu, edit), "ServiceAccount specdec-coordinator is granted")


def test_api_token_on_a_pod_that_never_calls_the_api_is_reported(cpu):
    def edit(objs):
        pod_spec(obj(objs, "Deployment", "specdec-target"))["automountServiceAccountToken"] = True
    assert_reported(problems_after(cpu, edit), "specdec-target", "automountServiceAccountToken: false")


def test_redis_url_on_the_wrong_port_is_reported(cpu):
    def edit(objs):
        [secret] = kind(objs, "Secret")
        secret["data"]["url"] = base64.b64encode(b"redis://specdec-redis:6380/0").decode()
    assert_reported(problems_after(cpu, edit), "Service specdec-redis", "no port 6380")


# --- network policies ----------------------------------------------------------------------------

def test_allow_all_ingress_policy_is_reported(cpu):
    def edit(objs):
        objs.append({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                     "metadata": {"name": "allow-all", "namespace": "specdec"},
                     "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{}]}})
    problems = problems_after(cpu, edit)
    assert_reported(problems, "allows a stranger pod in the namespace -> Deployment specdec-target:50062")
    assert_reported(problems, "allows a pod in another namespace -> StatefulSet specdec-redis:6379")


def test_policy_blocking_coordinator_to_target_is_reported(cpu):
    def edit(objs):
        obj(objs, "NetworkPolicy", "specdec-target")["spec"]["ingress"][0]["from"][0]["podSelector"][
            "matchLabels"]["app.kubernetes.io/component"] = "draft"
    problems = problems_after(cpu, edit)
    assert_reported(problems, "blocks Deployment specdec-coordinator -> Deployment specdec-target:50062")
    # The draft still cannot reach the target: its own egress policy denies everything.
    assert not any("allows Deployment specdec-draft" in p for p in problems)


def test_draft_egress_opened_is_reported(cpu):
    def edit(objs):
        obj(objs, "NetworkPolicy", "specdec-draft")["spec"]["egress"] = [{}]
        obj(objs, "NetworkPolicy", "specdec-redis")["spec"]["ingress"][0]["from"].append(
            {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "draft"}}})
    assert_reported(problems_after(cpu, edit), "allows Deployment specdec-draft -> StatefulSet specdec-redis:6379")


def test_pod_without_any_policy_is_reported(cpu):
    def edit(objs):
        objs[:] = [o for o in objs if not (o["kind"] == "NetworkPolicy" and name(o) == "specdec-redis")]
    assert_reported(problems_after(cpu, edit), "allows a stranger pod in the namespace -> StatefulSet specdec-redis")


def test_external_redis_without_an_egress_rule_is_reported(rendered):
    def edit(objs):
        egress = obj(objs, "NetworkPolicy", "specdec-coordinator")["spec"]["egress"]
        egress[:] = [r for r in egress if not any("ipBlock" in p and p["ipBlock"]["cidr"] != "0.0.0.0/0"
                                                  for p in r.get("to") or [])]
    assert_reported(problems_after(rendered["gpu+external-redis"], edit), "external Redis", "egress")


# --- transport security (issue 16) --------------------------------------------------------------

def test_plaintext_without_insecure_is_reported(cpu):
    def edit(objs):
        container(objs, "specdec-draft")["args"].remove("--insecure")
    assert_reported(problems_after(cpu, edit), "specdec-draft", "plaintext on --host 0.0.0.0 is refused")


def test_backends_without_a_client_ca_are_reported(rendered):
    def edit(objs):
        args = container(objs, "specdec-target")["args"]
        i = args.index("--tls-client-ca")
        del args[i:i + 2]
    assert_reported(problems_after(rendered["gpu+tls"], edit), "specdec-target", "accepts any client")


def test_a_coordinator_speaking_plaintext_to_tls_backends_is_reported(rendered):
    def edit(objs):
        args = container(objs, "specdec-coordinator")["args"]
        for flag in ("--upstream-ca", "--upstream-cert", "--upstream-key"):
            i = args.index(flag)
            del args[i:i + 2]
        args.append("--insecure")
    assert_reported(problems_after(rendered["gpu+tls"], edit), "specdec-coordinator", "speaks plaintext")


def test_a_certificate_outside_a_secret_volume_is_reported(rendered):
    def edit(objs):
        set_arg(container(objs, "specdec-draft"), "--tls-key", "/etc/specdec/draft.key")
    assert_reported(problems_after(rendered["gpu+tls"], edit), "specdec-draft", "--tls-key", "mounted Secret")


def test_tls_probes_on_the_tls_port_are_reported(rendered):
    def edit(objs):
        container(objs, "specdec-draft")["livenessProbe"]["grpc"]["port"] = 50061
    assert_reported(problems_after(rendered["gpu+tls"], edit), "specdec-draft", "livenessProbe", "plaintext health")
