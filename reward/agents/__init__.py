"""Agent episodes (`task.agent`): untrusted agent code, run once per sample, trained token-exactly.

One job a module:
- `server`: the OpenAI-compatible endpoint the agents call (episodes, routes), with
  `http_limits` (what keeps it up under hostile clients);
- `pool`: the driver's side of the episode processes (a zygote, a sandboxed process per episode);
- `runner`: the rollout `Source` that opens an episode per request and turns its calls and its
  outcome into one Sample;
- `openenv`, `verifiers`: the framework episodes (an OpenEnv environment, a verifiers taskset)
  played as agents.

Importing this package imports nothing heavy: each module is imported where it is used (the zygote
of another interpreter imports `pool` with the standard library only).
"""
