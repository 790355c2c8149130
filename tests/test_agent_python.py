"""task.agent_python: agent code runs in another interpreter (a virtual environment of its own, for
packages whose pins conflict with ours, e.g. verifiers' openai < 3): its episodes import what that
environment has and nothing of ours beyond the standard library; a bad interpreter or an agent that
does not load there is refused before Ray starts, naming the field."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from reward.agents.pool import AgentLimits, AgentPool
from reward.loader import RewardLoadError

AGENT = '''
import sys

import only_in_the_other_env


def solve(base_url, row, scale=1.0):
    """Proves where it ran: the other environment's package and interpreter, none of ours."""
    heavy = [m for m in ("torch", "ray", "vllm", "transformers", "numpy") if m in sys.modules]
    assert not heavy, heavy
    return scale * only_in_the_other_env.VALUE + (sys.prefix == only_in_the_other_env.PREFIX)
'''


@pytest.fixture(scope="module")
def other_env(tmp_path_factory) -> tuple[str, str]:
    """(a bare venv's python, a folder with the agent): the venv holds a module ours lacks."""
    root = tmp_path_factory.mktemp("other")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    python = str(root / "venv" / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], check=True, capture_output=True,
                            text=True).stdout.strip()
    Path(site, "only_in_the_other_env.py").write_text(f"VALUE = 7.0\nPREFIX = {prefix!r}\n")
    (root / "agents").mkdir()
    (root / "agents" / "elsewhere.py").write_text(AGENT)
    return python, str(root / "agents")


def _run(pool: AgentPool, row: dict, wait_s: float = 30.0):
    pool.start("job", "http://127.0.0.1:1/v1", row)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for _, outcome in pool.results(0.5):
            return outcome
    raise AssertionError("no outcome")


@pytest.mark.slow  # a venv and a zygote of its own (~3 s)
def test_an_agent_runs_in_the_interpreter_named(other_env) -> None:
    python, agents = other_env
    pool = AgentPool("elsewhere:solve", agents, 1, AgentLimits(20.0), {"scale": 2.0}, python=python)
    try:
        outcome = _run(pool, {"prompt": "p"})
    finally:
        pool.close()
    assert outcome.error is None and outcome.value == 15.0  # 2 x 7, +1: it ran with the venv's prefix
    with pytest.raises(RewardLoadError, match="No module named 'only_in_the_other_env'"):
        AgentPool("elsewhere:solve", agents, 1, AgentLimits(20.0))  # ours lacks the package


@pytest.mark.slow
def test_an_interpreter_reached_through_a_symlink_still_imports_its_packages(other_env, tmp_path) -> None:
    """A virtualenv linked from elsewhere (here, under /tmp, which each sandbox has fresh): its
    sys.path names the link, which is not there inside; the zygote follows links first."""
    python, agents = other_env
    linked = tmp_path / "linked"
    linked.symlink_to(Path(python).parent.parent, target_is_directory=True)
    pool = AgentPool("elsewhere:solve", agents, 1, AgentLimits(20.0), python=str(linked / "bin" / "python"))
    try:
        outcome = _run(pool, {"prompt": "p"})
    finally:
        pool.close()
    assert outcome.error is None and outcome.value == 7.0  # its package imported; its prefix is the link's


@pytest.mark.slow
def test_bad_interpreters_and_agents_are_refused_naming_the_field(other_env, tmp_path, make_config) -> None:
    from launch.components import load_agent
    from rl.config.schema import ConfigError
    from rl.config.validation import validate

    python, agents = other_env
    with pytest.raises(ConfigError, match=r"task.agent_python='/no/such/python' is not an executable file"):
        validate(make_config("task=calculator_agent", "task.agent_python=/no/such/python"))
    with pytest.raises(ConfigError, match=r"task.agent_python='.*' runs task.agent, which is not set"):
        validate(make_config(f"task.agent_python={python}"))
    with pytest.raises(RewardLoadError, match=r"task.agent='elsewhere:solve': its interpreter '/no/such/python' "
                                              r"does not start \(\[Errno 2\]"):
        AgentPool("elsewhere:solve", agents, 1, AgentLimits(20.0), python="/no/such/python")
    with pytest.raises(RewardLoadError, match=r"the process loading it \(/bin/true\) exited with code 0"):
        AgentPool("elsewhere:solve", agents, 1, AgentLimits(20.0), python="/bin/true")  # not a Python
    # load_agent checks it where it will run (the other interpreter), before Ray starts
    cfg = make_config("task=calculator_agent", f"task.agent={agents}/elsewhere.py:solve", f"task.agent_python={python}")
    assert load_agent(cfg) is None
    cfg = make_config("task=calculator_agent", f"task.agent={agents}/elsewhere.py:solve",
                      f"task.agent_python={sys.executable}")
    with pytest.raises(RewardLoadError, match="No module named 'only_in_the_other_env'"):
        load_agent(cfg)
