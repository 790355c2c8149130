"""The loop's stages around `rl/loop.py`: collecting and scoring samples, step metrics and
guards, checkpoints, evaluation, the asynchronous rollout pipeline, and the GPU hand-over between
colocated roles. (Actor plumbing is below: rl/actors; the run's log: rl/log.)"""
