"""What a run accepts: the structured config schemas (RL runs in `schema`, SFT and reward-model
runs in `supervised`), the checks a type cannot express (`validation`, which only reads a config),
run before anything starts, and `compose` to build one in Python."""
