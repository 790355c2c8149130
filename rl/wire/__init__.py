"""The weight sync, learner -> rollout engines, one module per transport (collective.py,
object_store.py, ipc.py: each with the learner's sender, the rollout side's receiver and the
driver's strategy), their contract (base.py) and choice (transports.py), the wire format
(format.py), delta syncs (delta.py) and LoRA adapters on the wire (lora.py). Both sides import
it, so it lives in the lowest layer; Ray and vLLM come in from outside (rl/wire/ipc.py)."""
