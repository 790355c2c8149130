"""Imports point one way: no import cycle between our files, and no import from a lower layer to a
higher one. Every import counts, also one inside a function.

    rl  <-  rollout, sandbox, trainer  <-  reward  <-  examples  <-  launch
    (bench and tests may import anything; nothing imports launch)

`rl` itself imports no Ray, DeepSpeed or vLLM. Inside it, its sub-packages point one way too:

    rl.actors  <-  rl.wire, rl.config, rl.data, rl.log  <-  rl.algo (math; may read config), rl.plan
        <-  rl.run  <-  rl.loop

(`rl.actors` is the actor plumbing every group uses; `rl.run` holds the loop's stages, which
compose the math: scoring, collecting, step metrics; only the loop and the launcher use them)

and `rl.algo`, the algorithm math, imports no I/O at all (files, processes, sockets, pickling),
only tensors. Run alone: `python -m pytest tests/test_layers.py`.
"""

from __future__ import annotations

import ast
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
    "rl.actors": set(),  # actor plumbing (groups, fan-out, deadlines, faults): the bottom layer
    "rl.wire": {"rl.actors"},  # the learner <-> rollout wire: both sides import it
    "rl.config": set(),
    "rl.data": set(),
    "rl.log": {"rl.actors", "rl.config", "rl.data"},  # the run's log, for the loop and the supervised trainers
    "rl.algo": {"rl.config"},
    "rl.plan": {"rl.wire"},
    "rl.run": {"rl.actors", "rl.log", "rl.config", "rl.data", "rl.algo", "rl.plan"},
    "rl.loop": {"rl.actors", "rl.log", "rl.wire", "rl.config", "rl.data", "rl.algo", "rl.plan", "rl.run"},
}
# the loop's own stages: no component below the launcher reaches them (issue 61: rollout/,
# trainer/, reward/ and sandbox/ imported rl.run only for its actor plumbing)
LOOP_ONLY = ("rl.run", "rl.loop")
PURE_MATH_MAY_IMPORT = {"__future__", "dataclasses", "typing", "math", "torch"}


def _modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of our packages under `root`."""
    out = {}
    for package in ALLOWED:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
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


def _graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Module -> the modules of ours it imports, and module -> the outside top-level packages it imports."""
    modules = _modules(root)
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


def _rl_part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def upward_imports(ours: dict[str, set[str]]) -> list[str]:
    """Imports from one package to another that ALLOWED does not list."""
    return [f"{a} imports {b}" for a, targets in sorted(ours.items()) for b in sorted(targets)
            if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in ALLOWED[a.split(".")[0]]]


def rl_forbidden_imports(external: dict[str, set[str]]) -> list[str]:
    """Modules of rl that import Ray, DeepSpeed or vLLM."""
    return [f"{m} imports {sorted(ext & FORBIDDEN_IN_RL)}" for m, ext in sorted(external.items())
            if m.split(".")[0] == "rl" and ext & FORBIDDEN_IN_RL]


def rl_upward_imports(ours: dict[str, set[str]]) -> list[str]:
    """Imports between rl's sub-packages that RL_ALLOWED does not list (a sub-package RL_ALLOWED
    does not name is reported too: it has no rule)."""
    return [f"{a} imports {b}" for a, targets in sorted(ours.items()) if a.startswith("rl.") for b in sorted(targets)
            if b.startswith("rl.") and _rl_part(b) != _rl_part(a)
            and _rl_part(b) not in RL_ALLOWED.get(_rl_part(a), ())]


def impure_math_imports(external: dict[str, set[str]]) -> list[str]:
    """Modules of rl.algo that import anything beyond PURE_MATH_MAY_IMPORT."""
    return [f"{m} imports {sorted(ext - PURE_MATH_MAY_IMPORT)}" for m, ext in sorted(external.items())
            if _rl_part(m) == "rl.algo" and ext - PURE_MATH_MAY_IMPORT]


def test_no_import_cycles() -> None:
    ours, _ = _graph()
    assert _cycles(ours) == []


def test_imports_point_down_the_layers() -> None:
    ours, _ = _graph()
    assert upward_imports(ours) == []


def test_rl_imports_no_ray_deepspeed_or_vllm() -> None:
    _, external = _graph()
    assert rl_forbidden_imports(external) == []


def test_rl_sub_packages_point_one_way() -> None:
    ours, _ = _graph()
    parts = {_rl_part(m) for m in ours if m.startswith("rl.")}
    assert parts == set(RL_ALLOWED), f"rl has sub-packages the rule does not name: {parts ^ set(RL_ALLOWED)}"
    assert rl_upward_imports(ours) == []


def test_the_algorithm_math_imports_no_io() -> None:
    _, external = _graph()
    assert len([m for m in external if _rl_part(m) == "rl.algo"]) >= 9
    assert impure_math_imports(external) == []


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path) -> None:
    """The rules above, run on a small tree written here with one breach of each kind (absolute,
    relative and in-function imports), report exactly those breaches, and none in its clean modules;
    and the walk of the real tree is not vacuous."""
    _write_tree(tmp_path, {
        "rl/__init__.py": "",
        "rl/config/__init__.py": "from .schema import Config\n",
        "rl/config/schema.py": "import dataclasses\n",
        "rl/wire/__init__.py": "",
        "rl/wire/codec.py": "from rl.config.schema import Config\n",  # rl.wire may import no other part of rl
        "rl/algo/__init__.py": "",
        "rl/algo/losses.py": "import math\nimport torch\nfrom ..config import schema\n",  # clean
        "rl/algo/kl.py": "from __future__ import annotations\n\ndef f():\n    import os.path\n",  # I/O
        "rl/algo/a.py": "from . import b\n",  # a <-> b: a cycle through relative imports
        "rl/algo/b.py": "from .a import f\n",
        "rl/loop.py": "import ray\nfrom rl.algo import losses\n\ndef g():\n    from trainer import engine\n",
        "trainer/__init__.py": "",
        "trainer/engine.py": "import deepspeed\nimport rl.config.schema\n",  # clean (only rl may not use DeepSpeed)
        "rollout/__init__.py": "",
        "rollout/worker.py": "import vllm\nfrom rl.wire import codec\nfrom launch.train import main\n",
        "launch/__init__.py": "",
        "launch/train.py": "import rl.loop\nfrom trainer.engine import x\n",  # clean: launch may use all
    })
    ours, external = _graph(tmp_path)
    assert ours["launch.train"] == {"rl.loop", "trainer.engine"}
    assert ours["rl.config"] == {"rl.config.schema"} and ours["rl.algo.losses"] == {"rl.config.schema"}
    assert _cycles(ours) == [["rl.algo.a", "rl.algo.b"]]
    assert upward_imports(ours) == ["rl.loop imports trainer.engine", "rollout.worker imports launch.train"]
    assert rl_forbidden_imports(external) == ["rl.loop imports ['ray']"]
    assert rl_upward_imports(ours) == ["rl.wire.codec imports rl.config.schema"]
    assert impure_math_imports(external) == ["rl.algo.kl imports ['os']"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

    ours, _ = _graph()  # the real tree: every package's modules found, relative imports resolved
    assert {"rl.loop", "trainer.learner", "examples.arith", "launch.train", "sandbox.pool"} <= set(ours)
    assert "rl.config.schema" in ours["rl.loop"] and "trainer.engine" in ours["trainer.learner_setup"]


# A string that names code of ours ("reward.agents.openenv:episode", "rollout.vllm_worker.SyncExtension")
# is a dependency as much as an import: the code it names is loaded by it. Such names count as imports
# below, for cycles and for the layers. (A bare module name does not: "sandbox.backend" is a config key.
# The built-in tasks' table, rl/data/builtins.py, names its task modules so, each imported by name only
# to build its missing directory.)
_NAMED = __import__("re").compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(:[A-Za-z_][\w.]*)?")
# reward/ takes from trainer/ only the model code a reward model is scored with
REWARD_MAY_IMPORT_FROM_TRAINER = {"trainer.reward_model"}


def _named_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours whose code string constants of `path` (docstrings aside) name whole:
    `module:attribute` or `module.Attribute` (a bare module or a top-level package's attribute does
    not count: "sandbox.backend" and "rollout.n" are config keys)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docstrings:
            continue
        match = _NAMED.fullmatch(node.value.strip())
        if not match:
            continue
        target = match.group(1) if match.group(2) else match.group(1).rpartition(".")[0]
        if target in modules and "." in target:
            found.add(target)
    return found


def _graph_with_names(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports or names (`_named_modules`)."""
    modules = _modules(root)
    ours, _ = _graph(root)
    for name, path in modules.items():
        ours[name] |= _named_modules(path, modules) - {name}
    return ours


def reward_imports_of_trainer(ours: dict[str, set[str]]) -> list[str]:
    """Imports from reward/ into trainer/ beyond the model code reward models need."""
    return [f"{a} imports {b}" for a, targets in sorted(ours.items()) if a.split(".")[0] == "reward"
            for b in sorted(targets) if b.split(".")[0] == "trainer" and b not in REWARD_MAY_IMPORT_FROM_TRAINER]


def launch_imports_of_examples(ours: dict[str, set[str]]) -> list[str]:
    """Modules of launch/ that import examples/ (what the launcher needs of the built-in tasks is
    rl/data/builtins.py, which names them)."""
    return [f"{a} imports {b}" for a, targets in sorted(ours.items()) if a.split(".")[0] == "launch"
            for b in sorted(targets) if b.split(".")[0] == "examples"]


def test_named_modules_count_as_imports_for_cycles_and_layers() -> None:
    """No cycle and no upward dependency through a module named in a string either: rl/config names
    no reward code (the OpenEnv expansion lives in reward/agents/), and inside rollout/ the vLLM
    worker extension, which vllm_engine names, does not reach up to the actor module that starts
    the engine (rollout/adapters.py is below both)."""
    ours = _graph_with_names()
    assert "rollout.vllm_worker" in ours["rollout.vllm_engine"]  # the names are seen
    assert "reward.agents.openenv" in ours["reward.agents.openenv_task"]
    assert _cycles(ours) == []
    assert upward_imports(ours) == []
    assert rl_upward_imports(ours) == []
    assert "rollout.worker" not in ours["rollout.vllm_worker"]


def test_reward_takes_only_model_code_from_trainer_and_launch_nothing_from_examples() -> None:
    """reward/ imports of trainer/ only `trainer.reward_model` (not the SFT trainer's helpers: the pad
    id is rl/data/padding.py); the launcher imports nothing of examples/ (the built-in tasks' table
    and builder: rl/data/builtins.py)."""
    ours = _graph_with_names()
    assert reward_imports_of_trainer(ours) == []
    assert launch_imports_of_examples(ours) == []


def loop_stage_imports(ours: dict[str, set[str]]) -> list[str]:
    """Modules of the components (rollout, trainer, reward, sandbox) that import the loop's stages."""
    return sorted(f"{m} imports {t}" for m, targets in ours.items() if m.split(".")[0] in
                  ("rollout", "trainer", "reward", "sandbox")
                  for t in targets if any(t == p or t.startswith(p + ".") for p in LOOP_ONLY))


def test_components_stand_on_the_actor_plumbing_not_on_the_loops_stages() -> None:
    """Issue 61: rollout/, trainer/, reward/ and sandbox/ imported `rl.run` (the loop's stages) only
    to reach the actor group and its faults (now rl/actors, the bottom layer) and the run's log
    (rl/log); none of them imports rl.run or rl.loop."""
    assert loop_stage_imports(_graph_with_names()) == []


def test_the_loop_stage_checker_sees_a_component_reaching_up() -> None:
    ours = {"trainer.group": {"rl.run.faults", "rl.actors.group"}, "rl.run.collect": {"rl.actors.faults"},
            "reward.service": {"rl.loop"}, "sandbox.pool": {"rl.actors.faults"}}
    assert loop_stage_imports(ours) == ["reward.service imports rl.loop", "trainer.group imports rl.run.faults"]


def test_the_named_module_checker_sees_names_and_skips_keys(tmp_path) -> None:
    """On a small tree: a `module:attribute` string and a `module.Class` string are dependencies
    (here an upward one and a cycle), a config key ("rollout.n") and a docstring are not."""
    _write_tree(tmp_path, {
        "rl/__init__.py": "",
        "rl/config/__init__.py": "",
        "rl/config/schema.py": ('"""Names reward.agents.openenv:episode in prose."""\n'
                                'AGENT = "reward.agents.openenv:episode"\n'),
        "rl/config/checks.py": 'KEYS = ["rollout.n", "rollout.engine"]\n',
        "reward/__init__.py": "",
        "reward/agents/__init__.py": "",
        "reward/agents/openenv.py": "",
        "rollout/__init__.py": "",
        "rollout/engine.py": 'EXT = "rollout.ext.Extension"\n',
        "rollout/ext.py": "def f():\n    from rollout.worker import g\n",
        "rollout/worker.py": "from rollout import engine\n",
    })
    ours = _graph_with_names(tmp_path)
    assert ours["rl.config.schema"] == {"reward.agents.openenv"} and ours["rl.config.checks"] == set()
    assert upward_imports(ours) == ["rl.config.schema imports reward.agents.openenv"]
    assert _cycles(ours) == [["rollout.engine", "rollout.ext", "rollout.worker"]]


# The Tinker service (launch/tinker/): a package of its own under the command line (launch/serve.py)
# and its Cluster. It imports rl, rollout and trainer only, nothing else of launch (the command line
# hands it what launch knows: cores, environments), and never repairs the fleet itself: the Cluster's
# repair, on the command line's main thread, is the one path.
TINKER_SERVICE = "launch.tinker"
TINKER_MAY_IMPORT = {"rl", "rollout", "trainer"}


def tinker_service_imports(ours: dict[str, set[str]]) -> list[str]:
    """Imports of the Tinker service's package beyond TINKER_MAY_IMPORT and itself."""
    return [f"{a} imports {b}" for a, targets in sorted(ours.items())
            if a == TINKER_SERVICE or a.startswith(TINKER_SERVICE + ".") for b in sorted(targets)
            if not (b == TINKER_SERVICE or b.startswith(TINKER_SERVICE + ".")) and b.split(".")[0] not in TINKER_MAY_IMPORT]


def test_the_tinker_service_is_a_package_under_the_command_line_with_one_repair_path() -> None:
    """Its parts each one job (protocol, request checks, registry, calls, server), its imports one
    way (not into the rest of launch, which only the command line uses), no `repair(` call in it,
    and the command line the only module of launch that imports it."""
    ours = _graph_with_names()
    parts = {"app", "proto", "checks", "registry", "service", "futures", "batching", "server"}
    assert {f"{TINKER_SERVICE}.{p}" for p in parts} <= set(ours)
    assert tinker_service_imports(ours) == []
    users = sorted(a for a, targets in ours.items() if a.split(".")[0] == "launch"
                   and not a.startswith(TINKER_SERVICE) and any(b.startswith(TINKER_SERVICE) for b in targets))
    assert users == ["launch.serve"]
    for path in sorted((ROOT / "launch" / "tinker").glob("*.py")):
        assert ".repair(" not in path.read_text(), f"{path.name} repairs the fleet: the Cluster does (launch/serve.py)"
    assert "cluster.repair()" in (ROOT / "launch" / "serve.py").read_text()
    # and the checker sees a breach: the service importing the rest of launch
    assert tinker_service_imports({"launch.tinker.service": {"launch.cluster", "rollout.fleet"}}) == \
        ["launch.tinker.service imports launch.cluster"]
