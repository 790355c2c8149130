"""A stand-in for the agent server (`reward.agents.runner.EpisodeServer`) in tests of the runner
alone: episodes open with made-up keys and URLs, close with the calls given."""

from __future__ import annotations


class FakeEpisodeServer:
    def __init__(self, calls=()):
        self.opened, self.calls = 0, list(calls)

    def open_episode(self, seed_base, metadata=None, temperature=None):
        self.opened += 1
        return f"key{self.opened}", f"http://127.0.0.1:1/{self.opened}/v1"

    def end_episode(self, key, at=None):
        pass

    def refusal(self, key):
        return None

    def close_episode(self, key):
        return list(self.calls)
