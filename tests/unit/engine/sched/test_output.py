"""SchedulerOutput's parts: what a new request carries to the runner."""

from __future__ import annotations

from engine.request import Request
from engine.request_options import RequestOptions
from engine.sampling_params import SamplingParams
from engine.sched.output import NewRequestData


def test_a_new_request_carries_its_sampling_and_an_earlier_legs_output() -> None:
    params = SamplingParams(presence_penalty=0.5, logit_bias={3: 1.0})
    options = RequestOptions(num_output_tokens_in_prompt=1)
    request = Request("r", [5, 6, 7], params, options=options)
    request.num_computed_tokens = 2
    new = NewRequestData.from_request(request, ([4],))
    assert new.sampling_params is params
    assert new.num_output_tokens_in_prompt == 1
    assert (new.prompt_token_ids, new.block_ids, new.num_computed_tokens) == ([5, 6, 7], ([4],), 2)
