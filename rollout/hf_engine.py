"""transformers `generate` backend: the reference implementation and a fallback without vLLM."""

from __future__ import annotations

import zlib
from typing import Iterable

import torch

from rl.data.types import GenerationRequest, Sample
from rollout.protocol import BatchQueue, RolloutSpec, each_or_refused, finish_reason


class HFEngine(BatchQueue):
    def __init__(self, spec: RolloutSpec, seed: int = 0, batch_size: int = 64):
        """`seed` is unused: HF generate seeds each batch from its requests' seeds."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.rollout = spec.rollout
        path = spec.model.path
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, spec.model.dtype)).to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else self.tokenizer.eos_token_id])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.batch_size = batch_size
        self.version = 0

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        """Batches of requests with the same budget and temperature (HF generate takes one of each);
        a request with token ids outside the vocabulary, or a negative budget or temperature, is
        refused on its own."""
        return each_or_refused(self._generate, requests, (ValueError, IndexError), self.version)

    @torch.no_grad()
    def _generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        vocab = self.model.get_input_embeddings().num_embeddings
        for r in requests:
            if r.adapter or r.stop or r.stop_token_ids or r.top_k or r.top_p is not None or r.ignore_eos \
                    or r.prompt_logprobs:
                raise ValueError("the hf backend samples with the run's settings only (no adapter, stop, top_k, "
                                 "top_p, ignore_eos or prompt log-probs per request): use rollout.backend=vllm")
            if any(not 0 <= t < vocab for t in r.prompt_ids) or (r.max_tokens is not None and r.max_tokens < 1) \
                    or (r.temperature is not None and not 0 <= r.temperature <= 2):
                raise ValueError(f"token ids outside [0, {vocab}), max_tokens < 1 or temperature outside [0, 2]")
        kinds: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            kinds.setdefault((r.max_tokens, r.temperature), []).append(i)
        samples: list[Sample | None] = [None] * len(requests)
        for (max_tokens, temperature), index in kinds.items():
            for start in range(0, len(index), self.batch_size):
                part = index[start : start + self.batch_size]
                for i, s in zip(part, self._generate_batch([requests[i] for i in part], max_tokens, temperature)):
                    samples[i] = s
        return samples  # type: ignore[return-value]

    def _generate_batch(self, requests: list[GenerationRequest], max_tokens: int | None,
                        temperature: float | None) -> list[Sample]:
        sampling = self.rollout
        temperature = sampling.temperature if temperature is None else temperature
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, r in enumerate(requests):  # left padding: generation continues at the right edge
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attn[i, width - len(r.prompt_ids) :] = 1
        # HF generate draws from the global RNG: seed it from this batch's request seeds, so a
        # batch is reproducible (per-sample seeds independent of batching need vLLM).
        torch.manual_seed(zlib.crc32(repr([r.seed for r in requests]).encode()))
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=attn.to(self.device),
            **({"do_sample": True, "temperature": temperature, "top_p": sampling.top_p, "top_k": 0}
               if temperature > 0 else {"do_sample": False}),
            max_new_tokens=sampling.max_new_tokens if max_tokens is None else max_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids),
            output_scores=True,  # processed scores: after temperature/top-p, as sampled
            return_dict_in_generate=True,
        )
        new_tokens = out.sequences[:, width:].cpu()
        logp = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1).cpu()
        token_logp = logp.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        samples = []
        for i, r in enumerate(requests):
            toks = new_tokens[i].tolist()
            end = next((j + 1 for j, t in enumerate(toks) if t in self.eos_ids), len(toks))
            toks = toks[:end]
            samples.append(
                Sample(
                    prompt_ids=list(r.prompt_ids),
                    completion_ids=toks,
                    logprobs=token_logp[i, :end].tolist(),
                    finish_reason=finish_reason(toks, self.eos_ids),
                    policy_version=self.version,
                    prompt_text=r.prompt_text,
                    completion_text=self.tokenizer.decode(toks, skip_special_tokens=True),
                    group_id=r.group_id,
                    sample_index=r.sample_index,
                    metadata=r.metadata,
                )
            )
        return samples

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))
        self.version = version

    def sleep(self, level: int | None = None) -> None:
        pass

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        pass
