"""The run's log: `run_log` (metrics.jsonl, the step line, summary and reading them back) and
`loggers` (TensorBoard, wandb, MLflow sinks). Written by the RL loop and the supervised trainers
alike, so it sits below both."""
