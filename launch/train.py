"""`python -m launch.train [group=option ...] [key=value ...]`: one GRPO run as a Hydra app.

Bad input fails here, before Ray or any model starts: Hydra checks keys and types against
`rl.config.schema.TrainConfig`, then `launch.checks.check_inputs` everything else (ranges, host,
files, memory plan, run directory). `launch.components` builds the actors; this module composes
them into a run (`train`) and owns the command line. Heavy imports come after the checks.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from launch.checks import check_inputs, load_inputs
from launch.cli import INPUT_ERRORS, fail
from launch.cluster import Cluster
from launch.components import make_episodes, make_source, start_agents, start_ray
from launch.console import quiet_driver
from launch.report import reward_ends, step_reward, write_report_or_warn
from rl.run.colocation import GpuHandover
from rl.config.schema import TrainConfig


def reward_trend(history: list[dict[str, Any]], k: int = 5) -> dict[str, Any]:
    """Mean reward (and each reward function's mean) over the first and the last k steps
    (`launch.report.reward_ends`): a step without rewards (every sample failed) does not count, and
    a mean is None where none of its k steps had rewards, never an earlier step's (issue 58)."""
    steps = [m for m in history if "time/step_s" in m]
    k, first, last = reward_ends(history, k)
    out: dict[str, Any] = {"steps_run": len(steps), "steps_averaged": k, "first_steps_reward_mean": first,
                           "last_steps_reward_mean": last,
                           "steps_without_rewards": sum(step_reward(m) is None for m in steps)}
    for key in sorted({key for m in history for key in m if key.startswith("eval/") and not key.endswith("_count")}):
        values = [(m["step"], m[key]) for m in history if key in m]
        if len(values) >= 2:  # before the first update and after the last (or the last one made)
            out.setdefault("eval", {})[key] = {"first_step": values[0][0], "first": values[0][1],
                                               "last_step": values[-1][0], "last": values[-1][1]}
    names = sorted({key for m in steps for key in m if key.startswith("reward/") and key.endswith("_mean")})
    for key in names:
        first_k, last_k = ([m[key] for m in part if step_reward(m) is not None and _finite(m.get(key))]
                           for part in (steps[:k], steps[-k:]))
        if len(steps) >= 2 and (first_k or last_k):
            name = key.removeprefix("reward/").removesuffix("_mean")
            out.setdefault("components", {})[name] = {
                "first_steps_mean": statistics.fmean(first_k) if first_k else None,
                "last_steps_mean": statistics.fmean(last_k) if last_k else None}
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def train(cfg: DictConfig, inputs=None, resume_from=None, restarted: bool = False) -> dict[str, Any]:
    """Run one experiment from a validated, path-resolved config; returns the run summary.

    `resume_from`: the checkpoint to resume (`find_resume`'s or `latest`'s), or None for a fresh
    run; `rl/run/checkpoint.py:loop_start` alone reads it. `restarted`: a new attempt of a run
    that failed (its run directory is continued). A run that stops early (a signal, a lost actor,
    failing rewards) still writes summary.json, then raises."""
    import ray

    from launch.placement import report_placement
    from launch.supervise import stop_on_signals
    from rl.run import checkpoint
    from rl.actors.faults import StopRequest
    from rl.loop import run_loop
    from rl.log.run_log import RunLog
    from rl.data.padding import pad_id_of

    tokenizer, data, eval_data = inputs or load_inputs(cfg)
    config: TrainConfig = OmegaConf.to_object(cfg)  # typed, plain data: what the actors are built from
    start = checkpoint.loop_start(config, resume_from, data.curriculum)  # step, KL, curriculum, in flight
    log = RunLog(cfg.run.dir, cfg.run.steps, title=cfg.algorithm.name.upper(), progress=cfg.run.progress,
                 start_step=start.step, config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
                 resume=resume_from is not None or restarted, loggers=list(cfg.run.loggers),
                 config=OmegaConf.to_container(cfg, resolve=True),
                 sink_options={"project": cfg.run.project, "mlflow_tracking_uri": cfg.run.mlflow_tracking_uri})
    owns_ray = start_ray(cfg)
    cluster = agents = None
    failed, stop = False, StopRequest()
    with stop_on_signals(stop, log.write):  # until Ray is down: a second signal stops at once
        try:
            cluster = Cluster.start(cfg, config, log.write)  # every actor group, the weight sync joined
            fleet, learner, rewards = cluster.fleet, cluster.learner, cluster.rewards
            episodes = make_episodes(config, tokenizer, cluster.envs)
            agents = start_agents(config, tokenizer, fleet, cluster)
            report_placement(cfg.run.dir, fleet, learner, rewards, cluster.sandboxes, log.write, cluster.placement,
                             cluster.envs)
            handover = GpuHandover.of(config, cluster, learner)  # who holds the GPUs (rl/run/colocation.py)
            start.restore_actors(learner, cluster, handover, log.write)  # a resumed run's learner and weights
            handover.to_rollout()
            source = make_source(fleet, cluster, episodes, agents)
            run_loop(config, pad_id_of(tokenizer), data, source, rewards, learner, cluster, log, handover, start,
                     stop=stop, eval_data=eval_data)
            summary = reward_trend(log.rows())  # the rows the run wrote, not whatever else metrics.jsonl holds
            if cfg.run.save_final_model:
                final = os.path.join(cfg.run.dir, "final_model")
                adapter = os.path.join(cfg.run.dir, "final_adapter") if cfg.model.lora.rank > 0 else None
                with handover.learner_resident():
                    learner.save_pretrained(final, adapter)  # with LoRA: merged, and the adapters alone
                tokenizer.save_pretrained(final)
                summary["final_model"] = final
                if adapter:
                    summary["final_adapter"] = adapter
            summary = log.finish(summary)
            print_summary(summary, cfg.run.dir)
            write_report_or_warn(cfg.run.dir, log.rows())
            return summary
        except BaseException as err:
            failed = True
            if log.rows():
                log.finish({**reward_trend(log.rows()), "ended_early": f"{type(err).__name__}: {err}"})
            raise
        finally:
            log.close()
            if agents is not None:  # the agents killed first (never waited on), then their server
                agents.close()
                agents.server.stop()
            if cluster is not None:
                cluster.shutdown()
            if owns_ray or failed:  # a failed start may have left actors that no handle here reaches
                ray.shutdown()
            elif cluster is not None and cluster.placement is not None:
                ray.util.remove_placement_group(cluster.placement.group)


def print_summary(summary: dict[str, Any], run_dir: str) -> None:
    """The run's last lines: its reward at the start and at the end (a step without rewards never
    stands in for another: `(none had rewards)`), each reward function's, the held-out evaluation's."""
    k, first, last = summary["steps_averaged"], summary["first_steps_reward_mean"], summary["last_steps_reward_mean"]
    if first is None and last is None:
        print(f"No step had a reward (every sample's reward failed; see samples.jsonl). Run directory: {run_dir}")
        return
    print(f"Reward mean: first {k} steps {_mean(first)} -> last {k} steps {_mean(last)}. Run directory: {run_dir}")
    for name, trend in summary.get("components", {}).items():
        print(f"  {name}: first steps {_mean(trend['first_steps_mean'])} -> last steps "
              f"{_mean(trend['last_steps_mean'])}")
    for key in ("eval/greedy_pass_frac", "eval/pass_at_1"):
        if key in summary.get("eval", {}):
            e = summary["eval"][key]
            print(f"Held-out {key.removeprefix('eval/')}: {e['first']:.3f} after {e['first_step']} updates -> "
                  f"{e['last']:.3f} after {e['last_step']} updates")


def _mean(value: float | None) -> str:
    return "(none had rewards)" if value is None else f"{value:.3f}"


@hydra.main(config_path="../configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from launch.supervise import supervise

    quiet_driver()
    overrides = list(HydraConfig.get().overrides.task)
    try:
        inputs, resume_from = check_inputs(cfg, overrides)
    except INPUT_ERRORS as err:  # RewardLoadError and DataError are ValueErrors
        fail(err)
    supervise(cfg, lambda found, restarted: train(cfg, inputs, found, restarted), overrides, resume_from)


if __name__ == "__main__":
    main()
