"""The driver's machinery around `rl/loop.py`: checkpoints, the run directory and metric sinks,
fault deadlines, the asynchronous rollout pipeline, evaluation, and the GPU hand-over between
colocated roles."""
