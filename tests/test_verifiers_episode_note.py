"""The episode's note (reward/agents/runner.py `episode_note`, issue 59): what a framework episode
(reward/agents/verifiers.py, openenv.py) says besides its float reward, read by the runner from
the last such line of its output. `prompt: "rendered"` makes the sample's prompt text the model's
first rendered prompt; `truncated` keeps the reward and marks the sample truncated; `reward_parts`
names a refused reward's parts; an agent without a note keeps the row's prompt and is not
truncated. Fast: a scripted server and pool, no virtual environment (the real ones:
tests/test_verifiers_multiturn.py, tests/test_openenv.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from reward.agents.runner import EPISODE_NOTE, AgentRunner, episode_note
from rl.data.agent_calls import RecordedCall
from rl.data.types import GenerationRequest
from tests.episode_fakes import FakeEpisodeServer

CALLS = [RecordedCall([1, 5, 6], [7, 2], [-0.1, -0.2], [0, 0], "stop", "7"),
         RecordedCall([1, 5, 6, 7, 2, 8, 9], [3, 2], [-0.3, -0.4], [0, 0], "stop", "3")]


class _Pool:
    """Hands back, per started episode, the outcome given for its row (`value`, `error`, `tail`)."""

    def __init__(self):
        self.on_end, self.started = None, []

    def start(self, job_id, base_url, row):
        self.started.append((job_id, row))

    def results(self, wait_s):
        done = [(k, SimpleNamespace(value=row["value"], error=row.get("error"), log_tail=row["tail"]))
                for k, row in self.started]
        self.started = []
        return done

    def cancel(self, job_id):
        pass

    def close(self):
        pass


def _note(**fields) -> str:
    return EPISODE_NOTE + json.dumps(fields)


def _play(*rows: dict):
    runner = AgentRunner(FakeEpisodeServer(CALLS), _Pool(), SimpleNamespace(repair=lambda: None), name="agent.py:solve",
                         prompt_key="prompt", timeout_s=30.0, workers=4, max_len=64,
                         decode=lambda ids: " ".join(f"<{i}>" for i in ids))
    return runner.run([GenerationRequest([1, 5], "row's column", i, 0, seed=i, metadata=row)
                       for i, row in enumerate(rows)])


def test_a_note_sets_the_rendered_prompt_and_truncation_and_no_note_changes_nothing():
    plain, rendered, truncated = _play(
        {"value": 0.5, "tail": "some output\n"},
        {"value": 0.5, "tail": "log line\n" + _note(prompt="rendered") + "\n"},
        {"value": 0.25, "tail": _note(prompt="rendered", truncated="max_turns=2 reached") + "\n"})
    assert plain.error is None and plain.prompt_text == "row's column" and not plain.truncated
    assert rendered.error is None and rendered.prompt_text == "<1> <5> <6>" and not rendered.truncated
    assert truncated.error is None and truncated.truncated and truncated.turns[-1].reward == 0.25
    assert [t.role for t in truncated.turns] == ["model", "observation", "model"]


def test_a_refused_reward_names_its_parts_and_a_bad_note_is_ignored():
    beyond = "returned 1e+30, beyond task.agent_reward_bound=1e+06: return a reward within +-bound, or raise the bound"
    refused, bad = _play(
        {"value": None, "error": beyond, "tail": _note(reward_parts={"exact": 1.0, "judge": 1e30})},
        {"value": 1.0, "tail": EPISODE_NOTE + "{not json\n"})
    assert "task.agent_reward_bound" in refused.error and "its parts: exact=1.0, judge=1e+30" in refused.error
    assert bad.error is None and bad.prompt_text == "row's column" and not bad.truncated
    assert episode_note("x\n" + _note(truncated="a") + "\n" + _note(prompt="rendered")) == {"prompt": "rendered"}
    assert episode_note(EPISODE_NOTE + "[1, 2]") == {} and episode_note("") == {}
