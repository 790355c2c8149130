"""Agents that user code cannot break: a table of hostile agents (tests/hostile_agents.py) run
through the real agent server, the real runner and the real agent processes, in front of a real
model (the calculator task's tiny chat model through HFEngine, fp32). Each case's expected
outcome is asserted: an error sample naming the agent and the cause, a 4xx the episode survives, or nothing at all; and for the whole
table: every episode comes back, the engine never failed (no worker would have been restarted),
the driver's memory stayed bounded and no agent process is left."""

from __future__ import annotations

import json
import os
import threading
import time

import psutil
import pytest

from rl.config.schema import ModelConfig, RolloutConfig
from rl.data.types import GenerationRequest, Sample

HOSTILE = os.path.join(os.path.dirname(__file__), "hostile_agents.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
MAX_NEW_TOKENS = 8
MAX_PROCESSES = 32  # each agent's (AgentLimits.max_processes)

# case -> (text the episode's error must contain, or None for a good episode with reward 1.0;
#          what the agent's hostile request must have got back: status and the field named)
CASES: dict[str, tuple[str | None, dict | None]] = {
    "good": (None, None),
    "raise_before_call": ("raised RuntimeError: the agent gave up before calling", None),
    "never_call": ("made no model call", None),
    "call_then_hang": ("did not return within task.agent_timeout_s", None),
    "sys_exit": ("sys.exit(3)", None),
    "segfault": ("SIGSEGV", None),
    "busy_loop": ("did not return within task.agent_timeout_s", None),
    "fork_bomb": ("did not return within task.agent_timeout_s", None),  # and its forks bounded (below)
    "huge_return": ("returned a str, not a number", None),
    "print_flood": (None, None),
    "reward_nan": ("returned nan: not a finite number", None),
    "reward_inf": ("returned inf: not a finite number", None),
    "reward_str": ("returned a str, not a number", None),
    "wrong_key": (None, {"status": 404}),
    "neighbour_key": (None, {"status": 404}),
    "closed_key": (None, {"status": 404}),
    "models_closed_key": (None, {"status": 404}),
    "temperature_nan": (None, {"status": 400, "param": "temperature"}),
    "temperature_inf": (None, {"status": 400, "param": "temperature"}),
    "temperature_3": (None, {"status": 400, "param": "temperature"}),
    "temperature_0": (None, {"status": 400, "param": "temperature"}),
    "top_k": (None, {"status": 400, "param": "top_k"}),
    "token_id_negative": (None, {"status": 400, "param": "prompt[1]"}),
    "token_id_huge": (None, {"status": 400, "param": "prompt[1]"}),
    "max_tokens_huge": (None, {"status": 200}),
    "body_30mb": (None, {"status": 413}),
    "deep_json": (None, {"status": 400}),
    "lone_surrogate": (None, {"status": 400}),
    "idle_connections": (None, {"status": 200}),
    "stream_true": (None, {"status": 200}),
    # issue 47: a thread left posting to a module-global URL costs at most its own episode ("*": any
    # outcome; before, the calls of the reused worker's later episodes were rewritten); rewards out of bounds
    "leaky_thread": ("*", None),
    "reward_true": ("returned True (a bool)", None),
    "reward_huge": ("returned 1e+30, beyond task.agent_reward_bound=1e+06", None),
    "reward_neg_huge": ("returned -1e+30, beyond task.agent_reward_bound=1e+06", None),
    # issue 47: 4 agents holding 1,000 idle connections each, beside the first good episodes
    # (through its sandbox's relay, whose 64-connection cap closes the oldest, 1,000 connects may
    # outlast the deadline on a loaded host: either way only its own episode pays)
    "connection_flood": (("made no model call", "did not return within task.agent_timeout_s"), None),
    # issue 58: escapes from the sandbox, each tried, noted and failed; the episode itself goes on
    "tmp_writer": (None, None),
    "tmp_reader": (None, None),
    "proc_scan": (None, None),
    "forge_sibling": (None, None),
    "kill_zygote": (None, None),
    "write_run_dir": (None, None),
    "leave_cgroup": (None, None),
    "signal_driver": (None, None),
    "ptrace_sibling": (None, None),
    # results cross as data: nothing the driver unpickles, a reward read once
    "reduce_value": ("returned a Reduces, not a number", None),
    "system_exit_value": ("returned a Reduces, not a number", None),
    "float_subclass": ("returned a FlipFloat (a subclass of float)", None),
    "call_in_flight": (None, None),  # and only its first call is recorded (below)
}


class Notes:
    """The test's note taker on loopback, the one host service besides the agent server that the
    episodes may reach (an endpoint of the pool): each case POSTs what it saw to /<case>."""

    def __init__(self) -> None:
        import http.server

        notes = self.notes = {}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = self.rfile.read(int(self.headers["content-length"]))
                notes[self.path.strip("/")] = json.loads(body)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def notes():
    n = Notes()
    yield n
    n.close()


def _agent_processes() -> list[psutil.Process]:
    """This process's descendants that run agents (the pool's launcher, its zygote and their workers)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "reward.agents.episode" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:  # gone, or a zombie not yet reaped (a Ray worker's, say)
            pass
    return found


@pytest.fixture(scope="module")
def served(tiny_calc):
    """The real server in front of the calculator's tiny chat model (HFEngine), counting engine
    failures (each one would have cost a rollout worker)."""
    from transformers import AutoTokenizer

    from reward.agents.server import AgentServer, RequestRejected
    from rollout.hf_engine import HFEngine
    from rollout.protocol import RolloutSpec

    path = f"{tiny_calc[0]}/model"
    engine = HFEngine(RolloutSpec(ModelConfig(path=path, dtype="float32"),
                                  RolloutConfig(backend="hf", max_new_tokens=MAX_NEW_TOKENS, max_model_len=512), seed=0))
    lock, failures = threading.Lock(), []

    def generate(request: GenerationRequest) -> Sample:
        with lock:  # HFEngine draws from torch's global RNG: one generate at a time
            try:
                sample = engine.generate([request])[0]
            except Exception as err:  # noqa: BLE001 - an engine failure: the fleet would replace the worker
                failures.append(err)
                raise
        if sample.error is not None:
            raise RequestRejected(sample.error)
        return sample

    engine.generate([GenerationRequest([1, 2], "", 0, 0, seed=0)])  # its weights' pages in memory before measuring
    server = AgentServer(AutoTokenizer.from_pretrained(path), generate, max_new_tokens=MAX_NEW_TOKENS,
                         max_model_len=512)
    server.start()
    yield server, failures, len(engine.tokenizer)
    server.stop()


@pytest.mark.slow  # a real engine and 30 agent processes, ~25 s: the default lane, not the fast one
def test_hostile_agents_cost_their_own_episode_only(served, tmp_path, notes):
    from reward.agents.pool import AgentLimits, AgentPool
    from reward.agents.runner import AgentRunner

    server, failures, vocab = served
    key, closed_url = server.open_episode(seed_base=1)
    server.close_episode(key)
    spec = f"{HOSTILE}:act"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    marker = tmp_path / "unpickled"
    pool = AgentPool(spec, str(tmp_path), workers=6, limits=AgentLimits(timeout_s=8.0, memory_mb=1024,
                                                                         max_processes=MAX_PROCESSES),
                     kwargs={"notes_url": notes.url, "closed_url": closed_url, "vocab": vocab},
                     endpoints=[("127.0.0.1", server.port, server.handoff_path), ("127.0.0.1", notes.port)], hidden=[str(run_dir)])

    class Fleet:
        def repair(self) -> None:
            pass

    runner = AgentRunner(server, pool, Fleet(), name=spec, prompt_key="prompt", timeout_s=8.0, workers=6,
                         max_len=512, decode=None)
    me = psutil.Process()
    rss_before = me.memory_info().rss
    # first the leaky thread (before issue 47 the episodes after it shared its worker), then 4 floods
    # of connections with 2 good episodes beside them, then the rest
    order = ["leaky_thread", *["connection_flood"] * 4, "good", "good", "tmp_writer", *["tmp_reader"] * 3,
             *[c for c in CASES if c not in ("leaky_thread", "connection_flood", "tmp_writer", "tmp_reader")]]
    extra = {"run_dir": str(run_dir), "driver_pid": os.getpid(), "marker": str(marker)}
    requests = [GenerationRequest([1, 2], "2+2=", i, 0, seed=i, metadata={"case": case, **extra})
                for i, case in enumerate(order)]
    started = time.monotonic()
    try:
        samples = runner.run(requests)
        elapsed = time.monotonic() - started
        rss_growth = (me.memory_info().rss - rss_before) / 2**20
        agents = _agent_processes()
    finally:
        runner.close()
    print(f"{len(order)} hostile agents in {elapsed:.1f} s; driver RSS +{rss_growth:.0f} MiB")

    assert [s.group_id for s in samples] == list(range(len(order)))  # every episode came back
    for case, s in zip(order, samples):
        error, request = CASES[case]
        if error == "*":
            continue
        if error is None:
            assert s.error is None, f"{case}: {s.error}"
            assert [t.reward for t in s.turns if t.role == "model"][-1] == 1.0, case
        else:
            assert s.error is not None and any(e in s.error for e in (error if isinstance(error, tuple) else (error,))), \
                f"{case}: {s.error}"
            assert s.error.startswith(f"task.agent={spec} on prompt '2+2='"), s.error  # names the agent, the row
        if request is not None:
            facts = notes.notes[case]
            assert facts["status"] == request["status"], f"{case}: {facts}"
            if "param" in request:
                assert facts["param"] == request["param"], f"{case}: {facts}"
    seen = notes.notes
    assert_escapes_failed(seen, run_dir, marker)
    in_flight = samples[order.index("call_in_flight")]
    assert len([t for t in in_flight.turns if t.role == "model"]) == 1  # the call left in flight: not recorded
    assert pool.restarts == 0 and pool.out_of_service is None  # nothing an episode did took the zygote down
    notes = {case: seen[case] for case, (_, r) in CASES.items() if r}
    # a wrong key and a closed one are told apart by nothing
    assert notes["wrong_key"]["body"] == notes["closed_key"]["body"] == notes["neighbour_key"]["body"]
    assert notes["models_closed_key"]["body"] == notes["closed_key"]["body"]
    assert notes["max_tokens_huge"]["completion_tokens"] <= MAX_NEW_TOKENS
    assert notes["body_30mb"]["seconds"] < 2.0
    assert notes["stream_true"]["events"] >= 2
    # the fork bomb forked until the pids limit refused it (fewer processes than the limit, the
    # worker being one), not up to its own cap, and not one of them is left
    forked = seen["fork_bomb"]["forked"]
    assert 0 < forked < MAX_PROCESSES or not _pids_limited(), forked
    assert not failures, f"the engine failed on {len(failures)} request(s): {failures[:3]}"
    assert rss_growth < 100, f"the driver grew by {rss_growth:.0f} MiB"
    assert server.open_count() == 0
    _, alive = psutil.wait_procs(agents, timeout=5)  # the zygote (its workers die with their cgroups)
    assert agents and not alive, alive
    assert not _agent_processes()  # none of the bomb's forks either


def assert_escapes_failed(seen: dict, run_dir, marker) -> None:
    """What each escape case noted from inside its sandbox: every attempt failed (issue 58)."""
    assert seen["tmp_writer"] == {"wrote": True}
    for_readers = [seen["tmp_reader"]]
    code = [ROOT.split(os.sep)[2]] if ROOT.startswith("/tmp/") else []  # a checkout under /tmp: its folders
    assert all(r["found"] is False and r["tmp"] == code for r in for_readers), for_readers  # a private /tmp
    assert seen["proc_scan"]["pids"] == ["1"] and seen["proc_scan"]["found"] == 0, seen["proc_scan"]  # its own /proc
    assert set(seen["forge_sibling"]["pids"]) == {1}, seen["forge_sibling"]
    assert all(v != "worked" for v in seen["forge_sibling"]["tried"].values()), seen["forge_sibling"]
    assert seen["kill_zygote"]["ppid"] == 0, seen["kill_zygote"]  # its parent, the worker, is out of sight
    assert seen["write_run_dir"]["append"] in ("ENOENT", "EROFS", "EACCES"), seen["write_run_dir"]
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "reward/mean": 0.5}\n'
    assert seen["leave_cgroup"]["move"] in ("ENOENT", "EROFS", "EACCES"), seen["leave_cgroup"]
    assert seen["signal_driver"]["sigint"] in ("ESRCH", "EPERM"), seen["signal_driver"]
    assert all(v in ("EPERM", "ESRCH") for v in seen["ptrace_sibling"].values()), seen["ptrace_sibling"]
    assert not marker.exists()  # no return value was ever unpickled


def _pids_limited() -> bool:
    """Whether the pool can bound an agent's processes: with cgroups (pids), or as a user other
    than root (RLIMIT_NPROC; root ignores it)."""
    from reward.agents.pool import _cgroups_usable

    return _cgroups_usable() or os.getuid() != 0


@pytest.mark.slow  # a real engine and agent process
def test_a_call_after_the_agent_returned_is_refused_and_recorded_nowhere(served, tmp_path):
    # (the agent's own endpoint is the only one it needs: the server's)
    """Issue 47: the episode ends on the server as its agent returns (the pool's monitor, before the
    driver drains the outcome): a call made with its key after that (a thread or process it left,
    or anyone holding the key) gets a 404, and the episode holds only the agent's own call."""
    import httpx

    from reward.agents.pool import AgentLimits, AgentPool
    from reward.agents.runner import AgentRunner
    from tests.hostile_agents import GOOD

    server, failures, vocab = served
    spec = f"{HOSTILE}:act"
    pool = AgentPool(spec, str(tmp_path), workers=1, limits=AgentLimits(timeout_s=8.0, memory_mb=1024,
                                                                         max_processes=MAX_PROCESSES),
                     kwargs={"vocab": vocab}, endpoints=[("127.0.0.1", server.port, server.handoff_path)])

    class Fleet:
        def repair(self) -> None:
            pass

    runner = AgentRunner(server, pool, Fleet(), name=spec, prompt_key="prompt", timeout_s=8.0, workers=1,
                         max_len=512, decode=None)
    urls, ended = {}, threading.Event()
    start, end = pool.start, pool.on_end
    pool.start = lambda key, url, row: (urls.setdefault(key, url), start(key, url, row))[1]
    pool.on_end = lambda key, at=None: (end(key, at), ended.set())
    try:
        runner.submit([GenerationRequest([1, 2], "2+2=", 0, 0, seed=0, metadata={"case": "good"})])
        assert ended.wait(30), "the pool never ended the episode as its agent returned"
        [url] = urls.values()
        late = httpx.post(f"{url}/chat/completions", json=GOOD, timeout=30)  # the driver has not drained it yet
        assert late.status_code == 404, late.text
        [sample] = runner.drain(30)
    finally:
        runner.close()
    assert sample.error is None, sample.error
    assert [t.reward for t in sample.turns if t.role == "model"] == [1.0]  # its one call, nothing after
    assert not failures and server.open_count() == 0


E2E_CASES = ["good", "raise_before_call", "call_then_hang", "segfault", "reward_nan", "sys_exit", "temperature_0",
             "token_id_huge", "wrong_key", "max_tokens_huge"]


@pytest.mark.full  # a long hostile case (~4 min in CI); the default lane keeps the hostile table above
def test_a_run_with_hostile_agents_finishes_its_steps_without_losing_a_worker(tiny_calc, tmp_path, capfd, notes):
    """The real command's run (Ray, vLLM's AsyncLLM behind the agent server, DeepSpeed), lock-step,
    with one hostile agent per prompt: both steps finish, each failed episode is counted and named,
    the requests vLLM would have refused are 400s (no rollout worker replaced), and nothing of the
    agents is left afterwards."""
    from launch.train import train
    from rl.log.run_log import read_metrics
    from tests.conftest import compose_config

    out, _ = tiny_calc
    rows = tmp_path / "cases.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "What is 2+2?", "answer": "4", "case": c}) + "\n"
                            for c in E2E_CASES))
    cfg = compose_config(["task=calculator_agent", f"model.path={out}/model", f"task.train_files=[{rows}]",
                          f"task.agent={HOSTILE}:act", f"+task.agent_kwargs.notes_url={notes.url}",
                          f"task.agent_endpoints=[127.0.0.1:{notes.port}]",
                          "task.agent_timeout_s=4", f"task.prompts_per_step={len(E2E_CASES)}", "rollout.n=2",
                          "rollout.mode=batch", "algorithm.off_policy_steps=0", f"run.dir={tmp_path}/run",
                          "run.progress=false", "run.steps=2", "run.save_every=0", "run.save_final_model=false",
                          f"run.log_samples_per_step={2 * len(E2E_CASES)}"])
    started = time.monotonic()
    train(cfg)
    print(f"2 hostile steps in {time.monotonic() - started:.0f} s")
    printed = capfd.readouterr().out
    metrics = read_metrics(cfg.run.dir)
    assert len(metrics) == 2 and "replacing it" not in printed, printed[-3000:]
    failing = {"raise_before_call", "call_then_hang", "segfault", "reward_nan", "sys_exit"}
    for m in metrics:  # each failing agent's two episodes, every step; two of them killed at the deadline
        assert m["agent/errors_count"] == 2 * len(failing) and m["agent/timeouts_count"] == 2, m
        assert m["sync/logprob_max_abs_diff"] < 1e-3  # learner and engine agree on every model token
        assert f"{2 * len(failing)} reward errors ({2 * len(failing)} agents failed, 2 of them killed" in printed
    assert metrics[1]["sync/weights_mb"] > 0  # the update reached the engine before step 2 sampled
    logged = [json.loads(line) for line in open(f"{cfg.run.dir}/samples.jsonl")]
    by_case = {}
    for row in logged:
        by_case.setdefault(row["data"]["case"], []).append(row)
    for case in E2E_CASES:
        errors = [row["error"] for row in by_case[case]]
        if case in failing:
            assert all(e and e.startswith(f"task.agent={HOSTILE}:act") for e in errors), (case, errors)
        else:
            assert errors == [None] * len(errors) and all(r["reward"] == 1.0 for r in by_case[case]), (case, errors)
    for case, status in (("temperature_0", 400), ("token_id_huge", 400), ("wrong_key", 404), ("max_tokens_huge", 200)):
        assert notes.notes[case]["status"] == status, case
    assert not _agent_processes(), "agent processes outlived the run"


@pytest.mark.slow
@pytest.mark.full  # a long hostile case (a whole run); the default lane keeps the hostile-agent run above
def test_a_step_where_no_agent_made_a_call_names_the_agent_s_error(tiny_calc, tmp_path):
    """Every agent raises before its first call: each step is all error samples (no token was
    sampled), the learner's batch is still a batch, and after reward.max_failed_steps such steps
    the run stops naming the agent's own error (before: a crash deep in the batch builder)."""
    from launch.train import train
    from rl.actors.faults import RewardsFailing
    from rl.log.run_log import read_metrics
    from tests.conftest import compose_config

    out, _ = tiny_calc
    rows = tmp_path / "cases.jsonl"
    rows.write_text(json.dumps({"prompt": "What is 2+2?", "answer": "4", "case": "raise_before_call"}) + "\n")
    cfg = compose_config(["task=calculator_agent", f"model.path={out}/model", f"task.train_files=[{rows}]",
                          f"task.agent={HOSTILE}:act", "task.prompts_per_step=2", "rollout.n=2", "rollout.mode=batch",
                          "algorithm.off_policy_steps=0", "reward.max_failed_steps=2", f"run.dir={tmp_path}/run",
                          "run.progress=false", "run.steps=4", "run.save_final_model=false"])
    with pytest.raises(RewardsFailing, match="raised RuntimeError: the agent gave up before calling"):
        train(cfg)
    metrics = read_metrics(cfg.run.dir)
    assert len(metrics) == 2 and all(m["agent/errors_count"] == 4 for m in metrics)
