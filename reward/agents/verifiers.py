"""verifiers environments (its `v1` API: an `Env` or `SingleAgentEnv` with a taskset and reward
functions), played as agent episodes: `task.agent=reward.agents.verifiers:episode`.

verifiers pins `openai < 3` and `mcp 2.0.0`, which conflict with ours, so the episode runs in a
virtual environment of its own (`task.agent_python`, made by `launch/agent_env.sh verifiers`, with
the environment's package installed beside verifiers, as `prime env install` would). Per episode,
as prime-rl drives a verifiers environment: the environment is loaded by its id
(`vf.load_environment`), the row's `task_index` picks the task, and `env.run_episode` plays it
with a `ModelContext` whose client is the episode's base URL, which the agent server records token
for token (verifiers' own interception server sits between the harness and that URL). The reward
is the environment's: the trace's weighted `reward`, as verifiers computed it. An episode
verifiers reports as failed (`episode.ok` false) is an error sample with its errors' text.

The harness: verifiers' built-in `null` harness (the task's prompt, the model's reply) prepares its
chat program with `uv` from the package index when each process starts, which an offline host
cannot do. `ChatHarness` below does the same work in-process, as verifiers' `Harness.launch`
allows ("a harness may run its loop in-process ... as long as every model call goes through
endpoint"). It is the default; `harness` names another installed one (e.g. `null` where `uv` and
the index are reachable).

Runs where only the standard-library part of ours is importable. verifiers is imported at the top,
so the agent pool's zygote imports it once and every episode's fresh fork has it.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from typing import Any

import verifiers.v1 as vf
import verifiers.v1.harnesses  # noqa: F401 - resolving a plugin id imports these packages first (mcp:
import verifiers.v1.tasksets  # noqa: F401 - ~2.5 s): once, in the zygote, not in every episode
from openai import AsyncOpenAI

AsyncOpenAI(api_key="-", base_url="http://127.0.0.1:9").chat.completions  # noqa: B018 - the client's lazy imports (~0.8 s), in the zygote too

HARNESS_ID = "rlpost_chat_harness"  # verifiers imports a harness by a top-level module name
API_KEY_VAR = "RLPOST_VERIFIERS_API_KEY"  # the episode's URL is its credential; verifiers wants a variable


class ChatHarnessConfig(vf.HarnessConfig):
    pass


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """The task's prompt (its system prompt as a system message), one chat call to verifiers'
    interception endpoint, the reply recorded there: the `null` harness's work without a program."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in prompt or []]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ChatHarness"]  # what verifiers' harness loader looks for
sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])


def load(environment: str, taskset_args: dict | None = None, harness: str = HARNESS_ID) -> Any:
    """The environment `environment` (an installed package's module name, as verifiers resolves
    ids) with `taskset_args` for its taskset's config, on `harness`, in a subprocess runtime (the
    default runtime is a hosted sandbox)."""
    return vf.load_environment(vf.SingleAgentEnvConfig(
        taskset={"id": environment, **(taskset_args or {})},
        agent={"harness": {"id": harness}, "runtime": {"type": "subprocess"}}))


async def episode(base_url: str, row: dict, *, environment: str, taskset_args: dict | None = None,
                  harness: str = HARNESS_ID, index_key: str = "task_index", sampling: dict | None = None) -> float:
    """The task `row[index_key]` of `environment` played against the model at `base_url`; returns
    the trace's reward. `sampling`: verifiers' `SamplingConfig` fields (leave temperature and top_p
    unset: the agent server samples at the run's)."""
    index = row.get(index_key)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"row[{index_key!r}]={index!r}: expected a task index (an integer >= 0) of {environment}")
    env = load(environment, taskset_args, harness)
    task = next(itertools.islice(env.taskset, index, None), None)  # built lazily, up to the one played
    if task is None:
        raise ValueError(f"row[{index_key!r}]={index}: {environment} has fewer tasks than that")
    os.environ.setdefault(API_KEY_VAR, "unused")
    ctx = vf.ModelContext(model="policy", client=vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR),
                          sampling=vf.SamplingConfig(**(sampling or {})))
    async with env.serving():
        result = await env.run_episode(task, ctx)
    if not result.ok or not result.traces:
        errors = [e.message for e in result.errors] + [e.message for t in result.traces for e in t.errors]
        raise RuntimeError(f"verifiers episode of task {index} failed: {'; '.join(errors)[:2000] or 'no trace'}")
    return float(result.traces[0].reward)


def check_kwargs(*, environment: str, taskset_args: dict | None = None, harness: str = HARNESS_ID,
                 index_key: str = "task_index", sampling: dict | None = None) -> None:
    """Before Ray starts (reward.loader calls it where the episodes will run): the environment
    loads with these taskset arguments and harness, and `sampling` leaves the sampling to the run."""
    try:
        load(environment, taskset_args, harness)
    except Exception as exc:  # noqa: BLE001 - verifiers' own message, attributed to the fields
        raise ValueError(f"environment={environment!r} with taskset_args={taskset_args!r} and harness={harness!r} "
                         f"does not load in verifiers: {type(exc).__name__}: {str(exc)[:1000]} (install the "
                         "environment's package: bash launch/agent_env.sh verifiers PACKAGE)") from None
    if not isinstance(index_key, str) or not index_key:
        raise ValueError(f"index_key={index_key!r}: name the rows' task-index column")
    fixed = sorted({"temperature", "top_p"} & set(sampling or {}))
    if fixed:
        raise ValueError(f"sampling sets {fixed}: the agent server samples every call at rollout.temperature and "
                         "rollout.top_p (what the learner scores); remove them")
    vf.SamplingConfig(**(sampling or {}))


episode.check_kwargs = check_kwargs


def main(argv: list[str] | None = None) -> None:
    """`python -m reward.agents.verifiers ENVIRONMENT OUT.jsonl [TASKSET_ARGS_JSON]`, in the verifiers
    virtual environment: one row per task of the environment (`task_index`, and its prompt when it
    is text, else a label), the training rows for `task.agent=reward.agents.verifiers:episode`."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        raise SystemExit(main.__doc__)
    env = load(args[0], json.loads(args[2]) if len(args) == 3 else None)
    os.makedirs(os.path.dirname(os.path.abspath(args[1])), exist_ok=True)
    rows = 0
    with open(args[1], "w") as f:
        for index, task in enumerate(env.taskset):
            text = task.data.prompt if isinstance(task.data.prompt, str) and task.data.prompt else ""
            f.write(json.dumps({"prompt": text or f"{args[0]} task {index}", "task_index": index}) + "\n")
            rows += 1
    print(f"wrote {rows} rows to {args[1]}")


if __name__ == "__main__":
    main()
