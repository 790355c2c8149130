"""The Tinker service's request checks: everything a client sends is checked here, before any
actor sees it (a refused call never reaches one): token ids against the vocabulary, lengths against
the served context (an error names the prompt's length and the context), shapes, sizes, numbers,
the options the service does not serve. Each check returns what the call runs with, or raises the
client's `UserError` naming the field and the limit it broke."""

from __future__ import annotations

import os
from typing import Any

import torch

from launch.tinker.futures import UserError
from launch.tinker.proto import WireError, loss_config_of, tensor_from_proto, tokens_of
from rl.algo.datum_losses import NOT_SERVED, DatumLoss, DatumLossError
from rl.data.types import GenerationRequest

ADAM_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                 "grad_clip_norm": 0.0}


class RequestChecks:
    def __init__(self, serve: Any, vocab: int, max_len: int, max_new_tokens: int, model_name: str, base_path: str):
        """`serve`: the config's serve section (its limits); `vocab`: the tokenizer's size; `max_len`:
        the served context (rollout.max_model_len); `max_new_tokens`: a sample call's budget when it
        names none; `model_name`, `base_path`: the one base model served."""
        self.serve, self.vocab, self.max_len, self.max_new_tokens = serve, vocab, max_len, max_new_tokens
        self.model_name, self.base_path = model_name, base_path

    def tokens(self, tokens: list[int], where: str) -> None:
        bad = [t for t in tokens if not 0 <= t < self.vocab]
        if bad:
            raise UserError(f"{where}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab})")

    def base_model(self, base_model: str | None) -> None:
        same_folder = bool(base_model) and os.path.isdir(base_model) and os.path.samefile(base_model, self.base_path)
        if base_model and base_model != self.model_name and not same_folder:
            raise UserError(f"base_model={base_model!r}: this service serves {self.model_name!r} only (start "
                            "launch.serve with model.path=<that model> to serve another)")

    def lora(self, lora: dict[str, Any]) -> tuple[int, dict[str, bool], int]:
        """A new training model's LoRA settings: (rank, the train_* flags, seed)."""
        rank = lora.get("rank")
        if not isinstance(rank, int) or not 1 <= rank <= self.serve.max_lora_rank:
            raise UserError(f"lora_config.rank={rank!r}: must be an integer in [1, {self.serve.max_lora_rank}] "
                            "(serve.max_lora_rank)")
        flags = {k: bool(lora.get(k, True)) for k in ("train_attn", "train_mlp", "train_unembed")}
        if not any(flags.values()):
            raise UserError("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")
        seed = lora.get("seed")
        return rank, flags, int(seed) if seed is not None else 0

    def training_data(self, message: Any) -> tuple[DatumLoss, list[Any], int]:
        """A forward_backward's (or forward's) protobuf message: its loss, its data (trainer
        `Datum`s) and their input tokens in all."""
        from trainer.adapter_trainer import Datum

        try:
            loss = DatumLoss.of(message.loss_fn, loss_config_of(message))
            data, total = [], 0
            for i, d in enumerate(message.data):
                tokens = tokens_of(d.model_input, f"data[{i}].model_input")
                inputs = {name: tensor_from_proto(t, name) for name, t in d.loss_fn_inputs.items()}
                data.append(Datum(tokens, inputs))
                total += len(tokens)
                self.tokens(tokens, f"data[{i}].model_input")
                if "target_tokens" in inputs:
                    self.tokens(inputs["target_tokens"].flatten().tolist(), f"data[{i}].target_tokens")
                for name, t in inputs.items():
                    if t.dtype.is_floating_point and not torch.isfinite(t).all():
                        raise UserError(f"data[{i}].loss_fn_inputs[{name!r}] holds NaN or infinity")
        except (WireError, DatumLossError) as err:
            raise UserError(str(err)) from None
        if not data:
            raise UserError("forward_backward with no data: send at least one Datum")
        if total > self.serve.max_tokens_per_request:
            raise UserError(f"{total} tokens in one forward_backward: over serve.max_tokens_per_request="
                            f"{self.serve.max_tokens_per_request}; send fewer data per call", status=413)
        for i, d in enumerate(data):
            if len(d.tokens) + 1 > self.max_len:
                raise UserError(f"data[{i}] is {len(d.tokens)} input tokens + its last target = {len(d.tokens) + 1} "
                                f"tokens, over the served context of {self.max_len} tokens (rollout.max_model_len)")
        return loss, data, total

    def adam(self, adam: dict[str, Any]) -> dict[str, float]:
        """An optim_step's `adam_params`, the defaults filled in."""
        params = {**ADAM_DEFAULTS, **adam}
        unknown = sorted(set(params) - {"learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"})
        if unknown:
            raise UserError(f"adam_params: unknown keys {unknown}")
        try:
            params = {k: float(v) for k, v in params.items()}
        except (TypeError, ValueError):
            raise UserError(f"adam_params: every value must be a number, got {adam}") from None
        if not (params["learning_rate"] >= 0 and 0 <= params["beta1"] < 1 and 0 <= params["beta2"] < 1
                and params["eps"] > 0 and params["weight_decay"] >= 0 and params["grad_clip_norm"] >= 0):
            raise UserError(f"adam_params {params}: need learning_rate >= 0, beta1 and beta2 in [0, 1), eps > 0, "
                            "weight_decay >= 0, grad_clip_norm >= 0")
        return params

    def sample(self, body: dict[str, Any], adapter: str | None, default_seed: int) -> list[GenerationRequest]:
        """A sample call's (JSON SampleRequest) requests, one per sample, for a sampler of `adapter`
        (None: the base model); `default_seed` seeds a call that names no seed."""
        prompt = body.get("prompt") or {}
        tokens: list[int] = []
        for i, chunk in enumerate(prompt.get("chunks") or []):
            if chunk.get("type", "encoded_text") != "encoded_text" or not isinstance(chunk.get("tokens"), list):
                raise UserError(f"prompt.chunks[{i}]: only encoded_text chunks (token lists) are served")
            tokens += chunk["tokens"]
        if not tokens or not all(isinstance(t, int) for t in tokens):
            raise UserError("prompt: give at least one integer token id")
        self.tokens(tokens, "prompt")
        n = body.get("num_samples", 1)
        if not isinstance(n, int) or not 1 <= n <= self.serve.max_samples:
            raise UserError(f"num_samples={n!r}: must be an integer in [1, {self.serve.max_samples}] (serve.max_samples)")
        if body.get("record_stability_info"):
            raise UserError("record_stability_info is not served: " + NOT_SERVED["stable_reinforce"])
        params = body.get("sampling_params") or {}
        max_tokens = params.get("max_tokens")
        room = self.max_len - len(tokens)
        if room < 1:
            raise UserError(f"the prompt is {len(tokens)} tokens, which leaves no room to sample in the served context "
                            f"of {self.max_len} tokens (rollout.max_model_len): send a prompt of at most "
                            f"{self.max_len - 1} tokens")
        if max_tokens is None:
            max_tokens = min(self.max_new_tokens, room)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise UserError(f"sampling_params.max_tokens={max_tokens!r}: must be a positive integer")
        if max_tokens > room:
            raise UserError(f"sampling_params.max_tokens={max_tokens} after the prompt's {len(tokens)} tokens is over "
                            f"the served context of {self.max_len} tokens (rollout.max_model_len): at most {room} "
                            "tokens can be sampled after this prompt")
        if (n * (len(tokens) + max_tokens)) > self.serve.max_tokens_per_request:
            raise UserError(f"num_samples={n} x (the prompt's {len(tokens)} tokens + max_tokens={max_tokens}) = "
                            f"{n * (len(tokens) + max_tokens)} tokens is over serve.max_tokens_per_request="
                            f"{self.serve.max_tokens_per_request}", status=413)
        temperature, top_p = float(params.get("temperature", 1.0)), float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", -1))
        if not 0 <= temperature <= 10 or not 0 < top_p <= 1 or top_k == 0 or top_k < -1:
            raise UserError(f"sampling_params: temperature={temperature} must be in [0, 10], top_p={top_p} in (0, 1], "
                            f"top_k={top_k} -1 or >= 1")
        if any(body.get(k) for k in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k",
                                     "target_prompt_logprobs", "prompt_logprobs_last_n")):
            raise UserError("top-k, target and alternative-token log-probs are not served: ask for prompt_logprobs "
                            "only")
        stop = params.get("stop")
        strings = tokens_stop = None
        if isinstance(stop, str):
            strings = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and stop:
            strings = stop
        elif isinstance(stop, list) and all(isinstance(s, int) for s in stop) and stop:
            self.tokens(stop, "sampling_params.stop")
            tokens_stop = stop
        elif stop is not None and stop != []:
            raise UserError(f"sampling_params.stop={stop!r}: a string, a list of strings or a list of token ids")
        seed = params.get("seed")
        base_seed = int(seed) if seed is not None else default_seed
        requests = [GenerationRequest(prompt_ids=list(tokens), prompt_text="", group_id=0, sample_index=i,
                                      seed=(base_seed + i) % 2**31, max_tokens=max_tokens, temperature=temperature,
                                      adapter=adapter, top_p=top_p, top_k=top_k if top_k > 0 else None,
                                      stop=strings, stop_token_ids=tokens_stop, ignore_eos=stop == [],
                                      prompt_logprobs=bool(body.get("prompt_logprobs")) and i == 0)
                    for i in range(n)]  # (one prompt: its log-probs come with the first sample)
        return requests
