"""vLLM's SamplingParams of one request: the run's sampling unless the request sets its own."""

from __future__ import annotations

import pytest

from rl.config.schema import RolloutConfig
from rl.data.types import GenerationRequest
from rollout.vllm_engine import sampling_params

pytest.importorskip("vllm")


def _request(**own) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2], prompt_text="", group_id=0, sample_index=0, seed=7, **own)


@pytest.mark.parametrize("run, request_asks, expected", [(False, False, False), (True, False, True),
                                                          (False, True, True), (True, True, True)])
def test_ignore_eos_is_the_runs_or_the_requests(run, request_asks, expected):
    params = sampling_params(RolloutConfig(max_new_tokens=12, ignore_eos=run), _request(ignore_eos=request_asks))
    assert params.ignore_eos is expected
    assert params.max_tokens == 12 and params.seed == 7 and params.n == 1


def test_a_requests_own_budget_and_temperature_win():
    params = sampling_params(RolloutConfig(max_new_tokens=12, temperature=0.7), _request(max_tokens=3, temperature=0.0))
    assert (params.max_tokens, params.temperature) == (3, 0.0)
