"""`task.env=openenv:<EnvClient class or server URL>`, the shorthand for an OpenEnv environment,
expanded into what plays it: agent episodes of `reward/agents/openenv.py` (this module's neighbour,
which imports openenv-core and so runs only in the agent's own interpreter; this one needs neither).

The expansion is a step of its own, run on the composed config before it is validated
(`launch.checks.check_inputs`; in Python `rl.config.compose.compose(..., expand=expand_openenv)`):
validation only reads a config, and `rl.config` names no code of the layers above it.
"""

from __future__ import annotations

from typing import Any

from rl.config.schema import ConfigError, plain_dict

OPENENV_AGENT = "reward.agents.openenv:episode"
OPENENV_GENERIC_CLIENT = "openenv.core.generic_client:GenericEnvClient"  # openenv-core's dict-in, dict-out client


def expand_openenv(cfg: Any) -> None:
    """`task.env=openenv:<EnvClient class or server URL>`: an OpenEnv environment, whose server runs
    outside the trainer, so its episodes are agent episodes of reward/agents/openenv.py; task.agent
    and task.agent_kwargs are filled in from it (with task.env_kwargs and task.max_turns), and the
    server joins task.agent_endpoints. A URL alone plays through openenv-core's GenericEnvClient,
    actions and observations as dicts. Any other config is left as it is."""
    env = cfg.task.env
    if not (isinstance(env, str) and env.startswith("openenv:")):
        return
    target = env[len("openenv:"):].strip()
    if cfg.task.agent:
        raise ConfigError(f"task.env={env!r} plays its episodes as task.agent={OPENENV_AGENT}, and task.agent="
                          f"{cfg.task.agent!r} is set too: set task.agent=null")
    kwargs = {"max_turns": cfg.task.max_turns, **plain_dict(cfg.task.agent_kwargs), **plain_dict(cfg.task.env_kwargs)}
    if target.startswith(("http://", "https://")):
        kwargs["server_url"] = target
        kwargs.setdefault("client", OPENENV_GENERIC_CLIENT)
    elif ":" in target:
        kwargs["client"] = target
        if not kwargs.get("server_url"):
            raise ConfigError(f"task.env={env!r} needs its server's address: task.env_kwargs.server_url=http://HOST:PORT "
                              "(or task.env=openenv:http://HOST:PORT with openenv-core's generic client)")
    else:
        raise ConfigError(f"task.env={env!r}: expected openenv:package.module:EnvClientClass or openenv:http://HOST:PORT")
    cfg.task.agent, cfg.task.env = OPENENV_AGENT, None
    cfg.task.agent_kwargs, cfg.task.env_kwargs = kwargs, {}
    if kwargs.get("server_url") and kwargs["server_url"] not in cfg.task.agent_endpoints:  # episodes reach it
        cfg.task.agent_endpoints = [*cfg.task.agent_endpoints, kwargs["server_url"]]
