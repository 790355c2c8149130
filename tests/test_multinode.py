"""The docs' "Run on a Ray cluster" block (docs/clusters-and-gpus.md), run as written on one machine: a head and two worker
nodes started with `ray start` (one advertising `benchmark`), the code task submitted with
`ray job submit`. The rollout workers and learner rank land in one placement group, the sandbox
workers on the `benchmark` node, and the run finishes every step."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.full]  # several Ray nodes and a code run: the full lane

# CPUs of the docs' nodes (docs/clusters-and-gpus.md), in its order: the head (the reward worker), the node for the rollout
# worker and learner rank (their 2 bundles), the benchmark node (2 sandbox workers).
NODE_CPUS = (1, 2, 2)
# What this test changes in the job: the tiny size of a CI run (the rest is the docs' command).
TINY = ("run.steps=2", "task.prompts_per_step=4", "sandbox.slots_per_worker=1")


def readme_commands() -> list[list[str]]:
    """The commands of the first ```bash block under "## Run on a Ray cluster" (one per line after
    joining `\\`-continued lines; comments dropped)."""
    with open(os.path.join(ROOT, "docs", "clusters-and-gpus.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Run on a Ray cluster", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.strip() and not line.lstrip().startswith("#")]


def ray_json(cluster, *args: str):
    proc = cluster.ray(*args, f"--address={cluster.dashboard}", "--detail", "--format=json", "--limit=1000")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_readme_cluster_commands_place_the_roles_and_run_the_code_task(tiny_code, tmp_path, ray_cluster):
    model_dir, _ = tiny_code
    run_dir = str(tmp_path / "run")
    local = {"$HEAD": "127.0.0.1", "6379": str(ray_cluster.port), "8265": str(ray_cluster.dashboard_port),
             "/shared/tiny_code": model_dir, "/shared/runs/code-1": run_dir}

    def here(arg: str) -> str:
        for placeholder, value in local.items():
            arg = arg.replace(placeholder, value)
        return arg

    commands = [[here(a) for a in cmd] for cmd in readme_commands()]
    starts = [c for c in commands if c[:2] == ["ray", "start"]]
    builds = [c for c in commands if c[:3] == ["python", "-m", "examples.code_speedup"]]
    submits = [c for c in commands if c[:3] == ["ray", "job", "submit"]]
    assert len(starts) == 3 and "--head" in starts[0] and len(builds) == 1 and len(submits) == 1, commands
    assert len(commands) == 5, commands
    # The build command is what the `tiny_code` fixture ran (same function, same output layout).
    assert builds[0][3:] == ["--out", model_dir]

    for cmd, cpus in zip(starts, NODE_CPUS):
        ray_cluster.start(cmd[2:], num_cpus=cpus)
    proc = ray_cluster.ray(*submits[0][1:], *TINY, cwd=ROOT, timeout=600)
    logs = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "succeeded" in logs, logs[-4000:]
    for line in logs.splitlines():
        if line.startswith(("Nodes:", "Placement")):
            print(line)

    # Every step ran, with no sandbox failure.
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    assert [m["reward/errors_count"] for m in metrics] == [0, 0]
    assert os.path.exists(os.path.join(run_dir, "summary.json"))

    # Where the run says its actors landed.
    with open(os.path.join(run_dir, "actors.json")) as f:
        actors = json.load(f)
    by_role = {role: [a for a in actors if a["role"] == role] for role in ("rollout", "learner", "reward", "sandbox")}
    assert [len(by_role[r]) for r in by_role] == [1, 1, 1, 2]
    placed = by_role["rollout"] + by_role["learner"]
    group = placed[0]["placement_group"]
    assert group and all(a["placement_group"] == group for a in placed)
    assert sorted(a["bundle"] for a in placed) == [0, 1]
    assert all(a["placement_group"] is None for a in by_role["reward"] + by_role["sandbox"])
    benchmark_nodes = {a["node_id"] for a in by_role["sandbox"]}
    assert len(benchmark_nodes) == 1 and all(a["custom_resources"] == {"benchmark": 8.0} for a in by_role["sandbox"])
    assert not any("benchmark" in a["custom_resources"] for a in placed)  # packed on the other worker node
    assert len({a["node_id"] for a in actors}) == 3 and by_role["reward"][0]["head"]  # the reward worker: head
    # ... and what it printed: each actor under its role, with its node, pid and bundle
    printed = {line.split(" [")[0]: line for line in logs.splitlines() if line.startswith("Placement: ")}
    for a in actors:
        spot = f"{a['index']}: {a['node']} ({a['ip']}) pid {a['pid']}"
        spot += f" bundle {a['bundle']}" if a["bundle"] is not None else ""
        assert spot in printed[f"Placement: {a['role']}"], (spot, printed)

    # The docs' logs: `ray job logs <id>` gives the driver's output again; each node keeps its
    # processes' logs in session_latest/logs (here under each node's --temp-dir).
    job_id = re.search(r"Job '(raysubmit_\w+)' succeeded", logs).group(1)
    again = ray_cluster.ray("job", "logs", f"--address={ray_cluster.dashboard}", job_id)
    assert again.returncode == 0 and "step 2/2 | reward" in again.stdout and "Placement: sandbox [" in again.stdout
    node_logs = sorted(glob.glob(os.path.join(ray_cluster.temp, "n*", "session_latest", "logs")))
    assert len(node_logs) == 3 and os.path.exists(os.path.join(node_logs[0], f"job-driver-{job_id}.log"))
    assert all(glob.glob(os.path.join(d, "worker-*.out")) for d in node_logs)

    # What Ray itself recorded: the same actors in that placement group, the sandbox workers on the
    # benchmark node, and the group removed when the job's driver ended.
    ray_actors = ray_json(ray_cluster, "list", "actors")
    by_pid = {a["pid"]: a for a in ray_actors}
    for a in placed:
        assert by_pid[a["pid"]]["placement_group_id"] == group, by_pid[a["pid"]]
    for a in by_role["sandbox"]:
        assert by_pid[a["pid"]]["class_name"] == "SandboxWorker" and by_pid[a["pid"]]["node_id"] in benchmark_nodes
    groups = {g["placement_group_id"]: g for g in ray_json(ray_cluster, "list", "placement-groups")}
    assert groups[group]["state"] == "REMOVED", groups[group]
