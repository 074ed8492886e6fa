"""Asynchronous scheduling, the engine's side: one step in flight.

With ``async_scheduling`` the worker lives on a runner thread that built it
(torch's OpenMP team belongs to the thread that first runs a kernel, and a
second team beside it halved the step: benchmarks/JOURNAL.md, "serving_bench.py") and
executes every step, in order. Each ``StepPipeline.step()``:

1. schedules step N+1 with the AsyncScheduler, whose placeholders stand for
   the tokens step N is still sampling;
2. hands it to the runner thread, which starts it as soon as step N is
   done: the runner keeps step N's sampled ids in its persistent batch, so
   they become step N+1's input ids without passing through the scheduler;
3. waits for step N's output and applies it (stop checks, grammars,
   outputs).

So step N+1's forward runs while the engine thread does 3 and then 1 for
step N+2. A step whose constrained requests sample after a token still in
flight waits for that token before it is handed over: its grammar masks
need the grammar advanced by it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from engine.outputs import EngineCoreOutputs, ModelRunnerOutput
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.worker.worker import Worker


@dataclass(frozen=True)
class _InFlight:
    scheduler_output: SchedulerOutput
    future: Future[ModelRunnerOutput]


class StepPipeline:
    """Owns the runner thread; used only from the engine thread."""

    def __init__(self, runner_thread: ThreadPoolExecutor, idle_poll_seconds: float) -> None:
        self.runner_thread = runner_thread
        self.idle_poll_seconds = idle_poll_seconds
        self._in_flight: _InFlight | None = None

    @property
    def has_in_flight(self) -> bool:
        return self._in_flight is not None

    def step(self, scheduler: Scheduler, worker: Worker) -> EngineCoreOutputs:
        """Schedules and submits the next step, then returns the outputs of
        the one that was in flight ({} if none was)."""
        previous, self._in_flight = self._in_flight, None
        outputs = EngineCoreOutputs()
        so = scheduler.schedule() if scheduler.has_requests() else None
        if so is not None:
            if so.pending_grammar:
                if previous is not None:
                    outputs = self._finish(previous, scheduler)
                    previous = None
                scheduler.fill_grammar_bitmask(so)
            future = self.runner_thread.submit(worker.execute_model, so)
            self._in_flight = _InFlight(so, future)
        if previous is not None:
            outputs = self._finish(previous, scheduler)
        elif so is not None and so.total_num_scheduled_tokens == 0:
            # Only KV transfers to poll: don't spin.
            time.sleep(self.idle_poll_seconds)
        return outputs

    @staticmethod
    def _finish(step: _InFlight, scheduler: Scheduler) -> EngineCoreOutputs:
        runner_output = step.future.result()  # what the runner raised, raises here
        return scheduler.update_from_output(step.scheduler_output, runner_output)

    def wait_idle(self) -> None:
        """Returns once the runner thread runs nothing (the step in flight,
        if any, is done; its output is applied by the next ``step``)."""
        if self._in_flight is not None:
            wait([self._in_flight.future])

    def shutdown(self) -> None:
        self.wait_idle()
        self.runner_thread.shutdown(wait=True)
