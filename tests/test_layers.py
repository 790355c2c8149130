"""Imports point one way: no import cycle between our files, and no import from a lower layer to a
higher one. Every import counts, also one inside a function.

    rl  <-  rollout, sandbox, trainer  <-  reward  <-  examples  <-  launch
    (bench and tests may import anything; nothing imports launch)

`rl` itself imports no Ray, DeepSpeed or vLLM. Inside it, its sub-packages point one way too:

    rl.wire, rl.config, rl.data  <-  rl.algo (math; may read config), rl.plan, rl.run  <-  rl.loop

and `rl.algo`, the algorithm math, imports no I/O at all (files, processes, sockets, pickling),
only tensors. Run alone: `python -m pytest tests/test_layers.py`.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# package -> the packages of ours it may import (itself always)
ALLOWED = {
    "rl": set(),
    "rollout": {"rl"},
    "sandbox": {"rl"},
    "trainer": {"rl"},
    "reward": {"rl", "sandbox", "trainer"},
    "examples": {"rl", "sandbox", "trainer", "reward"},
    "launch": {"rl", "rollout", "sandbox", "trainer", "reward", "examples"},
    "bench": {"rl", "rollout", "sandbox", "trainer", "reward", "examples", "launch"},  # a user of it all, like tests
}
FORBIDDEN_IN_RL = {"ray", "deepspeed", "vllm"}
# rl's sub-packages -> the others of rl they may import (itself always); rl.loop, the recipe, any
RL_ALLOWED = {
    "rl.wire": set(),  # the learner <-> rollout wire: both sides import it
    "rl.config": set(),
    "rl.data": set(),
    "rl.algo": {"rl.config"},
    "rl.plan": {"rl.wire"},
    "rl.run": {"rl.config", "rl.data"},
    "rl.loop": {"rl.wire", "rl.config", "rl.data", "rl.algo", "rl.plan", "rl.run"},
}
PURE_MATH_MAY_IMPORT = {"__future__", "dataclasses", "typing", "math", "torch"}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of our packages."""
    out = {}
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The modules `path` imports (anywhere in the file): ours resolved to module names, others by
    their top-level name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # `from pkg import module` imports the module
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    resolved = set()
    for target in found:
        while target and target not in modules and "." in target:
            target = target.rpartition(".")[0]
        resolved.add(target)
    return resolved


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    ours, external = {}, {}
    for name, path in modules.items():
        imported = _imports(path, name, modules)
        ours[name] = {m for m in imported if m in modules and m != name}
        external[name] = {m.split(".")[0] for m in imported if m not in modules}
    return ours, external


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    ours, _ = _graph()
    assert _cycles(ours) == []


def test_imports_point_down_the_layers() -> None:
    ours, _ = _graph()
    upward = [f"{a} imports {b}" for a, targets in ours.items() for b in sorted(targets)
              if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in ALLOWED[a.split(".")[0]]]
    assert upward == []


def test_rl_imports_no_ray_deepspeed_or_vllm() -> None:
    _, external = _graph()
    bad = [f"{m} imports {sorted(ext & FORBIDDEN_IN_RL)}" for m, ext in external.items()
           if m.split(".")[0] == "rl" and ext & FORBIDDEN_IN_RL]
    assert bad == []


def _rl_part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_rl_sub_packages_point_one_way() -> None:
    ours, _ = _graph()
    parts = {_rl_part(m) for m in ours if m.startswith("rl.")}
    assert parts == set(RL_ALLOWED), f"rl has sub-packages the rule does not name: {parts ^ set(RL_ALLOWED)}"
    upward = [f"{a} imports {b}" for a, targets in ours.items() if a.startswith("rl.") for b in sorted(targets)
              if b.startswith("rl.") and _rl_part(b) != _rl_part(a) and _rl_part(b) not in RL_ALLOWED[_rl_part(a)]]
    assert upward == []


def test_the_algorithm_math_imports_no_io() -> None:
    _, external = _graph()
    math_modules = [m for m in external if m.startswith("rl.algo")]
    assert len(math_modules) >= 9
    bad = [f"{m} imports {sorted(ext - PURE_MATH_MAY_IMPORT)}" for m, ext in external.items()
           if m in math_modules and ext - PURE_MATH_MAY_IMPORT]
    assert bad == []


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path) -> None:
    """The walk is not vacuous: it finds every package's modules and resolves relative imports."""
    ours, _ = _graph()
    assert {"rl.loop", "trainer.learner", "examples.arith", "launch.train", "sandbox.pool"} <= set(ours)
    assert "rl.config.schema" in ours["rl.loop"] and "trainer.engine" in ours["trainer.learner"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert os.path.basename(__file__) == "test_layers.py"
