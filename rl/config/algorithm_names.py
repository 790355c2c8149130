"""The one list of the algorithm parts a config may name: advantage estimators, policy losses, loss
aggregations, KL estimators and controllers, importance corrections.

Torch-free and importing nothing of ours, so the config's validation (`rl/config/validation.py`) offers these
as choices and rejects a misspelled name before torch loads, and `rl.algo`'s registries
(`rl/algo/registry.py`) refuse to register a name that is not here. `tests/test_config.py` checks
that every registry's names equal these lists, both ways.

Adding an estimator (or loss, or any other part named here) takes:

1. its function, registered where its kind lives, with its contract: for an advantage estimator

       @ADVANTAGES.register("my_adv", kind="outcome", inputs=("group_ids",), settings=("norm_by_std",))
       def my_adv(rewards, valid, group_ids, norm_by_std): ...   # in rl/algo/advantages.py

   `kind` says how `rl/algo/estimate.py` calls it ("outcome": the sequence reward [B] and `valid`
   in, one advantage per sample out; "token": per-token rewards and `mask` [B, T] in, per-token
   advantages out); `inputs` the tensors it needs beyond those (`group_ids`, `values`,
   `old_logprobs`, `ref_logprobs`; one that needs `values` returns (advantages, returns));
   `settings` the `AlgorithmConfig` fields it takes as keyword arguments;
2. its name here, one line: in `ADVANTAGE_NAMES` with the inputs that ask something of the
   run's config (`group_ids`: several samples per prompt, rollout.n >= 2, and it may use
   algorithm.dynamic_sampling; `values`: a critic, algorithm.critic=true), which the registration
   must match (the registry refuses a mismatch); in the other lists the name alone;
3. its test.

Nothing else changes: the schema, the estimate step and the learner read the registrations.
"""

from __future__ import annotations

# The inputs of an advantage estimator that config validation must see: group_ids (more than one
# sample per prompt) and values (a learned critic).
CONFIG_CHECKED_INPUTS = ("group_ids", "values")

# algorithm.advantage -> the CONFIG_CHECKED_INPUTS it needs (rl/algo/advantages.py)
ADVANTAGE_NAMES: dict[str, tuple[str, ...]] = {
    "grpo": ("group_ids",),
    "rloo": ("group_ids",),
    "reinforce_pp": (),
    "gae": ("values",),
}
POLICY_LOSS_NAMES = ("ppo_clip", "ppo_dual_clip", "gspo", "cispo")  # algorithm.policy_loss (rl/algo/losses.py)
LOSS_AGG_NAMES = (  # algorithm.loss_agg (rl/algo/losses.py)
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm",
)
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3", "k3_clamped")  # algorithm.kl_estimator (rl/algo/kl.py)
KL_CTRL_NAMES = ("fixed", "adaptive")  # algorithm.kl_ctrl (rl/algo/kl_control.py)
IMPORTANCE_CORRECTION_NAMES = ("none", "token_tis", "token_mis", "icepop", "seq_mask", "behaviour_clip")  # (rl/algo/importance.py)

# config field -> the names it accepts; one rl.algo registry per field
ALGORITHM_CHOICES: dict[str, tuple[str, ...]] = {
    "algorithm.advantage": tuple(ADVANTAGE_NAMES),
    "algorithm.policy_loss": POLICY_LOSS_NAMES,
    "algorithm.loss_agg": LOSS_AGG_NAMES,
    "algorithm.kl_estimator": KL_ESTIMATOR_NAMES,
    "algorithm.kl_ctrl": KL_CTRL_NAMES,
    "algorithm.importance_correction": IMPORTANCE_CORRECTION_NAMES,
}
# config field -> name -> the CONFIG_CHECKED_INPUTS a registration under that name must ask for
CONFIG_INPUTS: dict[str, dict[str, tuple[str, ...]]] = {"algorithm.advantage": ADVANTAGE_NAMES}


def advantage_needs(name: str, what: str) -> bool:
    """Whether advantage estimator `name` needs input `what` (one of CONFIG_CHECKED_INPUTS) from the
    run; False for an unknown name (the choices check reports that)."""
    if what not in CONFIG_CHECKED_INPUTS:
        raise ValueError(f"{what!r} is not one of the inputs config validation sees: {CONFIG_CHECKED_INPUTS}")
    return what in ADVANTAGE_NAMES.get(name, ())


def advantages_needing(what: str) -> list[str]:
    """The advantage estimators that need input `what` (for config error messages)."""
    return [name for name in ADVANTAGE_NAMES if advantage_needs(name, what)]
