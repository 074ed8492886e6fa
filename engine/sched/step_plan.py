"""StepPlan: the schedule under construction during one ``schedule()``
call, and the runner's deltas for the requests it already holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_cache.manager import KVCacheBlocks
from engine.request import Request
from engine.sched.output import CachedRequestData


@dataclass
class StepPlan:
    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    req_to_new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    resumed_reqs: list[Request] = field(default_factory=list)
    running_reqs: list[Request] = field(default_factory=list)
    preempted_reqs: list[Request] = field(default_factory=list)
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The waiting head's last try found too few free blocks.
    head_lacks_blocks: bool = False

    def add(self, request: Request, num_new: int, blocks: KVCacheBlocks) -> None:
        """Schedule ``num_new`` of ``request``'s tokens into ``blocks``."""
        self.req_to_new_blocks[request.request_id] = blocks
        self.num_scheduled_tokens[request.request_id] = num_new
        self.token_budget -= num_new

    def unschedule(self, request: Request) -> None:
        """Undo a running request scheduled earlier in this step."""
        request_id = request.request_id
        self.running_reqs.remove(request)
        self.token_budget += self.num_scheduled_tokens.pop(request_id)
        del self.req_to_new_blocks[request_id]
        self.spec_decode_tokens.pop(request_id, None)

    def cached_request_data(
        self, prev_scheduled: dict[str, int], resync: set[str]
    ) -> CachedRequestData:
        """Deltas for the running (then resumed) requests scheduled.
        ``prev_scheduled``: the previous step's requests; ``resync``: those
        whose last step's tokens were voided."""
        data = CachedRequestData()
        new_blocks = self.req_to_new_blocks
        req_ids = data.req_ids
        new_block_ids = data.new_block_ids
        num_computed = data.num_computed_tokens
        num_output = data.num_output_tokens
        for req in self.running_reqs:
            req_id = req.request_id
            req_ids.append(req_id)
            if req_id not in prev_scheduled or req_id in resync:
                # Skipped last step: the runner may lack its newest token;
                # rewound: the runner holds a token that was voided.
                data.all_token_ids[req_id] = req.all_token_ids.copy()
            new_block_ids.append(new_blocks[req_id].get_block_ids(allow_none=True))
            num_computed.append(req.num_computed_tokens)
            num_output.append(len(req.output_token_ids) + req.num_output_placeholders)
            if req.num_output_placeholders:
                data.in_flight_req_ids.add(req_id)
        for req in self.resumed_reqs:
            req_id = req.request_id
            req_ids.append(req_id)
            data.resumed_req_ids.add(req_id)
            data.all_token_ids[req_id] = req.all_token_ids.copy()
            new_block_ids.append(new_blocks[req_id].get_block_ids(allow_none=True))
            num_computed.append(req.num_computed_tokens)
            num_output.append(len(req.output_token_ids))
        return data
