"""What crosses between the learner and the rollout engines: the weight-sync protocol and the
LoRA adapter names and merge (both sides import it, so it lives in the lowest layer)."""
