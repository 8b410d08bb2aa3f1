"""The import graph of the hand-written modules (module-level imports, read with ast): the rooms
of the house are separate packages, layered, without a cycle.

Layers, lowest first; a module may import its own layer and those below, never one above:
  base      specdec.errors
  backends  specdec/backends/: the model protocol and one module per backend (hf, fast, llamacpp,
            subset-head drafts) with their caches; not the measured choice between them
            (specdec.backends.choice loads models: it sits with the core)
  core      specdec/ (algorithms, model loading, training) outside the packages below
  runtime   specdec/service/: batching, session table, metrics: the services' grpc-free runtime
  wire      specdec/rpc/: generated stubs, conversion, serving, clients, security
  services  draft_service/, target_service/, coordinator/
  app       specdec/app/ (`specdec up`, `specdec client`), specdec/bench/ (every benchmark) and
            the CLI entry points
The cores of the services (`*/core.py` and what they import of their own package) sit below the
wire: they load no grpc (checked here at run time too, in a fresh interpreter)."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specdec", "draft_service", "target_service", "coordinator")
LAYERS = ("base", "backends", "core", "runtime", "wire", "services", "app")
APP_MODULES = {"specdec.cli", "specdec.__main__"}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def hand_written() -> dict[str, Path]:
    """Module name -> file, generated stubs (specdec/rpc/v1) left out."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "v1" in path.relative_to(ROOT).parts:
                continue
            out[module_name(path)] = path
    return out


def top_level_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The hand-written modules `name` imports when it loads (not inside functions, not only for
    type checkers)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def resolve(mod: str) -> None:
        while mod and mod not in known:
            mod = mod.rpartition(".")[0]
        if mod:
            found.add(mod)

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    resolve(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    resolve(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    found.discard(name)
    return found


def layer(name: str) -> str:
    if name == "specdec.errors":
        return "base"
    if name.startswith("specdec.backends") and name != "specdec.backends.choice":
        return "backends"
    if name in APP_MODULES or name.startswith(("specdec.app", "specdec.bench")):
        return "app"
    if name.startswith("specdec.service"):
        return "runtime"
    if name.startswith("specdec.rpc"):
        return "wire"
    if name.startswith(("draft_service", "target_service", "coordinator")):
        return "services"
    return "core"


def graph() -> dict[str, set[str]]:
    mods = hand_written()
    return {name: top_level_imports(path, name, set(mods)) for name, path in mods.items()}


def test_nothing_imports_a_layer_above_its_own():
    g = graph()
    up = sorted(f"{a} ({layer(a)}) imports {b} ({layer(b)})" for a, deps in g.items() for b in deps
                if LAYERS.index(layer(b)) > LAYERS.index(layer(a)))
    assert not up, "\n".join(up)


def test_the_backends_are_a_package_of_their_own():
    g = graph()
    backends = {m for m in g if layer(m) == "backends"}
    assert {"specdec.backends.base", "specdec.backends.hf", "specdec.backends.fast", "specdec.backends.llamacpp.model",
            "specdec.backends.subset_head", "specdec.backends.kv_cache"} <= backends
    outside = [m for m in g if m.rsplit(".", 1)[-1] in ("lm", "fast", "llamacpp", "kv_cache", "kv_stack", "backend_choice")
               and not m.startswith("specdec.backends")]
    assert not outside, outside


CAPABILITIES = ("returns_hidden", "runs_trees", "stacks_caches", "greedy_steps", "greedy_step", "head_rows", "backend")
BACKEND_CLASSES = ("CausalLM", "FastLlamaLM", "LlamaCppLM", "SubsetHeadLM")


def test_nothing_outside_the_backends_probes_what_a_model_is():
    """Capabilities are declared (specdec.backends.base.ModelBackend) and read as attributes: no
    getattr with a default on them and no isinstance on backend classes outside specdec/backends."""
    found = []
    for name, path in hand_written().items():
        if name.startswith("specdec.backends"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            if node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 and \
                    isinstance(node.args[1], ast.Constant) and node.args[1].value in CAPABILITIES:
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
            if node.func.id == "isinstance" and len(node.args) == 2 and \
                    any(c in ast.unparse(node.args[1]) for c in BACKEND_CLASSES):
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_the_service_runtime_is_a_package_of_its_own_and_the_wire_holds_no_runtime():
    g = graph()
    runtime = {m for m in g if layer(m) == "runtime"}
    assert {"specdec.service.batching", "specdec.service.session_table", "specdec.service.metrics"} <= runtime
    assert not any(m.startswith("specdec.rpc.") and m.rsplit(".", 1)[1] in ("batching", "session_table", "metrics",
                                                                             "launcher", "cli_commands") for m in g)
    assert {"specdec.app.launcher", "specdec.app.cli_commands"} <= set(g)


def test_the_services_cores_import_nothing_of_the_wire():
    g = graph()
    for core in ("draft_service.core", "target_service.core", "coordinator.core"):
        seen, todo = set(), [core]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            todo += [d for d in g[m] if layer(d) in ("services", "wire")]
        assert not {m for m in seen if layer(m) == "wire"}, f"{core} reaches the wire: " \
            f"{sorted(m for m in seen if layer(m) == 'wire')}"


def test_the_module_level_import_graph_has_no_cycle():
    g = graph()
    state: dict[str, int] = {}
    cycles = []

    def walk(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                walk(d, path + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            walk(m, [m])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _top(name: str) -> str:
    return name.split(".")[0]


def test_only_specdec_rpc_imports_grpc_and_nothing_in_specdec_imports_redis():
    wire = {"grpc", "grpc_health", "grpc_reflection", "grpc_tools"}
    offenders = []
    for pkg in ("specdec", "draft_service", "target_service", "coordinator"):
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT)
            names = _imports(path)
            in_rpc = rel.parts[:2] == ("specdec", "rpc")
            if not in_rpc and any(_top(n) in wire or n.startswith("google.protobuf") for n in names):
                offenders.append(f"{rel} imports grpc/protobuf")
            if pkg == "specdec" and any(_top(n) == "redis" for n in names):
                offenders.append(f"{rel} imports redis")
    assert not offenders, offenders


def _core_modules() -> list[str]:
    """Every module of the core and of the service runtime (specdec outside the wire, specdec/rpc/,
    and the application, specdec/app/ and specdec/bench/), entry points aside."""
    names = []
    for path in sorted((ROOT / "specdec").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[:2] in (("specdec", "rpc"), ("specdec", "app"), ("specdec", "bench")) or path.name == "__main__.py":
            continue
        names.append(".".join(rel.with_suffix("").parts).removesuffix(".__init__"))
    return names


# Imports each module in turn in a fresh interpreter and names the first one after which grpc,
# protobuf or redis is loaded (a later offender would be hidden by an earlier one: fix and rerun).
_LOADS = """
import importlib, json, sys
wire = ("grpc", "google.protobuf", "redis")
for name in sys.argv[1:]:
    importlib.import_module(name)
    loaded = [w for w in wire if w in sys.modules]
    if loaded:
        print(json.dumps([name, loaded]))
        break
"""


@pytest.mark.parametrize("group", ["specdec", "draft_service.core", "target_service.core", "coordinator.core"])
def test_the_core_and_each_services_core_load_neither_grpc_nor_redis(group):
    modules = _core_modules() if group == "specdec" else [group]
    out = subprocess.run([sys.executable, "-c", _LOADS, *modules], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out == "", f"importing {out.strip()} loads the wire"


def _first_party_imports() -> dict[str, set[str]]:
    """module -> the first-party modules it imports anywhere (top level, functions, TYPE_CHECKING)."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for pkg in ("specdec", "draft_service", "target_service", "coordinator") for p in (ROOT / pkg).rglob("*.py")}

    def module_of(name: str) -> Optional[str]:  # "pkg.mod.attr" -> "pkg.mod"
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {module_of(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {module_of(f"{node.module}.{a.name}") for a in node.names}
        graph[name] = found - {None, name}
    return graph


def test_first_party_modules_import_one_another_without_a_circle():
    try:
        tuple(graphlib.TopologicalSorter(_first_party_imports()).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")
