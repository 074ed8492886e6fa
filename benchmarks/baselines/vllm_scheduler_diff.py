"""vLLM's side of benchmarks/scheduler_diff.py: the same random traces
(``tests/unit/engine/sched/sched_traces.py``) through vLLM 0.12.0's own v1 scheduler. Run only by
that script, in an interpreter that has vllm installed; Tandem never
imports this file or vllm.

Prints one JSON line per trace (a ``TraceResult``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import deque
from pathlib import Path
from types import SimpleNamespace

# The repository root: the traces are a stdlib-only module of Tandem's tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm.config import SchedulerConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm_stub import make_scheduler

from tests.unit.engine.sched.sched_traces import (
    EOS,
    SCENARIOS,
    ConnectorScript,
    RequestSpec,
    Trace,
    as_async,
    make_trace,
    replay,
)

logging.disable(logging.WARNING)


class ScriptedConnector:
    """The scheduler half of a KV connector, answering from the script
    (duck-typed: the scheduler only calls these)."""

    def __init__(self, script: ConnectorScript) -> None:
        self.script = script

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.script.matched(request.request_id, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        (block_ids,) = blocks.get_block_ids()
        self.script.allocated(request.request_id, list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        return self.script.finished(request.request_id, list(block_ids)), None

    def update_connector_output(self, connector_output):
        pass

    def take_events(self):
        return ()

    def get_kv_connector_stats(self):
        return None

    def shutdown(self):
        pass


class VllmSide:
    def __init__(self, trace: Trace) -> None:
        cfg = trace.config
        self.script = ConnectorScript(trace)
        self.sched = make_scheduler(
            SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=cfg.max_model_len,
                is_encoder_decoder=False,
                enable_chunked_prefill=cfg.chunked_prefill,
                policy=cfg.policy,
                long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            ),
            max_model_len=cfg.max_model_len,
            num_blocks=cfg.num_blocks,
            block_size=cfg.block_size,
            prefix_caching=cfg.prefix_caching,
            structured_output_manager=SimpleNamespace(should_advance=lambda r: False),
            log_stats=False,
            scheduler_class=AsyncScheduler if cfg.async_scheduling else Scheduler,
        )
        if cfg.connector:
            self.sched.connector = ScriptedConnector(self.script)
        self.hasher = get_request_block_hasher(cfg.block_size, sha256)
        # Scheduled, not yet updated: one, or two with asynchronous scheduling.
        self.pending = deque()

    def add(self, spec: RequestSpec) -> None:
        params = SamplingParams(
            max_tokens=spec.max_tokens, min_tokens=spec.min_tokens, ignore_eos=spec.ignore_eos
        )
        self.sched.add_request(
            Request(
                spec.request_id,
                list(spec.prompt),
                params,
                None,
                eos_token_id=EOS,
                arrival_time=spec.arrival_time,
                priority=spec.priority,
                block_hasher=self.hasher,
            )
        )

    def schedule(self):
        so = self.sched.schedule()
        self.pending.append(so)
        return dict(so.num_scheduled_tokens), list(so.preempted_req_ids or ())

    def computed_and_total(self, request_id):
        request = self.sched.requests[request_id]
        return request.num_computed_tokens, request.num_tokens

    def num_output_tokens(self, request_id):
        return self.sched.requests[request_id].num_output_tokens

    def num_output_placeholders(self, request_id):
        return self.sched.requests[request_id].num_output_placeholders

    def update(self, sampled, finished_sending, finished_recving, invalid_block_ids):
        so = self.pending.popleft()
        req_ids = list(so.num_scheduled_tokens)
        kv_output = None
        if self.sched.connector is not None:
            kv_output = KVConnectorOutput(
                finished_sending=finished_sending,
                finished_recving=finished_recving,
                invalid_block_ids=invalid_block_ids,
            )
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=kv_output,
        )
        outputs = self.sched.update_from_output(so, output)
        return {
            o.request_id: str(o.finish_reason)
            for eco in outputs.values()
            for o in eco.outputs
            if o.finish_reason is not None
        }

    def waiting_for_remote(self):
        return [
            r.request_id
            for r in self.sched.waiting
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        ]

    def has_requests(self):
        return bool(self.sched.requests) or self.sched.has_finished_requests()

    def num_free_blocks(self):
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def notes(self):
        return []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--traces", type=int, default=0)
    parser.add_argument("--scenarios", action="store_true", help="the hand-made traces instead")
    parser.add_argument("--async-scheduling", action="store_true", help="AsyncScheduler")
    args = parser.parse_args()
    init_none_hash(sha256)
    if args.scenarios:
        traces = list(SCENARIOS.values())
    else:
        traces = [make_trace(s) for s in range(args.first_seed, args.first_seed + args.traces)]
    if args.async_scheduling:
        traces = [as_async(t) for t in traces]
    for trace in traces:
        result = replay(trace, VllmSide(trace))
        print(json.dumps(result.to_json()), flush=True)


if __name__ == "__main__":
    main()
