"""What a run accepts: the structured config schemas (RL runs in `schema`, SFT and reward-model
runs in `supervised`), checked before anything starts, and `compose` to build one in Python."""
