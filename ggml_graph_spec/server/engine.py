"""The engine thread: the one owner of the model and its continuous-batching generator.

HTTP handlers talk to it only through `submit`, `cancel`, `slot_action` and `shutdown` (thread-safe
queues and one lock); it answers through each job's queue (jobs.py). Its loop:

1. take every command that came in (new jobs, cancellations, slot actions, stop), waiting for
   one only when nothing runs;
2. start waiting jobs in free slots (slots.py picks the slot with the longest cached prefix);
3. one step: ONE `Model.decode` for every running job (a new prompt's prefill chunk, or each
   decoding job's last token), then each job's next token, posted to its handler.

A job joins or leaves between two steps; a cancelled job (its client went away) leaves at the
next one and frees its slot.

A fault while one job is started, sampled or ended (an exception from its sampler, its constraint,
its reply parser) fails THAT job (a 500 naming the exception, one log line) and frees and empties
its slot; a fault of the model's step fails the jobs of that step. The engine serves on: only a
fault of its own loop ends it.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from gguf_arch.errors import KimiError

from ..engine.inputs import EMBEDDING_POS
from ..engine.model import Model
from ..generation.batch import BatchGenerator, Request
from ..generation.events import StopRules
from ..generation.sampling import Sampler
from ..chat.constraint import Constraint
from ..chat.reply import ReplyParser
from .errors import SERVER, SHUTTING_DOWN, ApiError, unavailable
from .jobs import Job
from .slot_files import SlotFiles
from .slots import Checkpoint, Slot, choose


@dataclass
class Stats:
    """Counters the metrics report (written by the engine thread only)."""

    n_decode: int = 0
    busy_slots: int = 0  # summed over decode calls
    requests: int = 0
    cache_hits: int = 0  # requests that reused a cached prefix
    cached_tokens: int = 0  # prompt tokens they did not compute


class Engine:
    def __init__(self, model: Model, *, queue_size: int, checkpoints: int, prefill_chunk: int | None,
                 slot_files: SlotFiles | None = None, log: Callable[[str], None] = lambda _line: None):
        self.model = model
        self.batch = BatchGenerator(model, prefill_chunk=prefill_chunk)
        self.slots = [Slot(i, checkpoints) for i in range(model.n_seq)]
        self.queue_size = queue_size
        self.stats = Stats()
        self.slot_files = slot_files
        self._log = log
        self._eos = model.tokenizer.eos_id
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: deque[Job] = deque()
        self._running: dict[Request, Job] = {}
        self._lock = threading.Lock()
        self._outstanding = 0  # jobs submitted and not ended: running + waiting
        self._closing = False
        self._stopped = False
        self.failure: BaseException | None = None
        self._clock = 0
        self._thread = threading.Thread(target=self._run, name="kimi-k3-engine", daemon=True)

    # ---- any thread ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or refuse it at once: 503 while stopping, or with every slot busy and the
        queue full (with Retry-After)."""
        with self._lock:
            if self._closing or self.failure is not None:
                raise unavailable(SHUTTING_DOWN)
            if self._outstanding >= len(self.slots) + self.queue_size:
                raise unavailable(f"all {len(self.slots)} slots are busy and the queue of {self.queue_size} is full "
                                  "(--queue); retry later", retry_after=1)
            self._outstanding += 1
        self._inbox.put(("job", job))

    def cancel(self, job: Job) -> None:
        """The client went away: end the job at the next step (a no-op once it ended)."""
        job.cancel_requested.set()
        self._inbox.put(("cancel", job))

    def slot_action(self, slot: int, action: str, filename: str | None) -> concurrent.futures.Future:
        """save / restore / erase, run by the engine thread between steps (slot_files.py)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("slot", (slot, action, filename, future)))
        return future

    def shutdown(self) -> None:
        """Refuse new jobs; end every waiting and running one at the next step (503)."""
        with self._lock:
            self._closing = True
        self._inbox.put(("stop", None))

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def deferred(self) -> int:
        return len(self._waiting)

    @property
    def processing(self) -> int:
        return len(self._running)

    def slot_view(self) -> list[dict]:
        """/slots: each slot's state (a snapshot; the lists are copied whole by the engine)."""
        return [{"id": s.id, "n_ctx": self.model.n_ctx, "is_processing": s.busy, "n_tokens": len(s.history),
                 "checkpoints": len(s.checkpoints), "checkpoint_bytes": s.checkpoint_bytes()} for s in self.slots]

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._take_commands(block=not self._running and not self._waiting)
                if self._stopped:
                    break
                self._start_waiting()
                if self._running:
                    self._step()
        except BaseException as exc:  # noqa: BLE001 - a fault of the engine itself: fail loudly, once
            self.failure = exc
            self._log(f"error: engine stopped: {type(exc).__name__}: {exc}")
        if self.failure is None:
            self._end_all(unavailable(SHUTTING_DOWN))
        else:
            self._end_all(ApiError(500, SERVER, f"engine failure: {type(self.failure).__name__}: {self.failure}"))

    def _take_commands(self, block: bool) -> None:
        try:
            item = self._inbox.get() if block else self._inbox.get_nowait()
            while True:
                self._command(*item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _command(self, kind: str, value) -> None:
        try:
            self._do(kind, value)
        except Exception as exc:  # noqa: BLE001 - one command's fault is its job's, not the engine's
            if kind == "cancel":
                request = next((r for r, j in self._running.items() if j is value), None)
                self._failed(value, exc, request)
            else:
                raise

    def _do(self, kind: str, value) -> None:
        if kind == "job":
            self._waiting.append(value)
            self.stats.requests += 1
        elif kind == "cancel":
            self._cancel(value)
        elif kind == "slot":
            self._slot_action(*value)
        elif kind == "stop":
            self._stopped = True

    def _cancel(self, job: Job) -> None:
        if job in self._waiting:
            self._waiting.remove(job)
            self._ended(job, "cancelled")
            return
        request = next((r for r, j in self._running.items() if j is job), None)
        if request is not None:
            self.batch.cancel(request, "cancelled")
            self._finish(request, "cancelled")

    def _slot_action(self, slot_id: int, action: str, filename: str | None, future) -> None:
        try:
            slot = self.slots[slot_id]
            if slot.busy:
                raise unavailable(f"slot {slot_id} is processing a request; try again when it is idle")
            future.set_result(self.slot_files.run(self.model, slot, action, filename))
        except ApiError as exc:
            future.set_exception(exc)
        except Exception as exc:  # noqa: BLE001 - the action's own fault (slot_files says what it knows)
            self._log(f"error: slot {slot_id}: {action}: {type(exc).__name__}: {exc}")
            future.set_exception(ApiError(500, SERVER, f"slot {slot_id}: {action} failed ({type(exc).__name__})"))

    def _start_waiting(self) -> None:
        while self._waiting:
            job = self._waiting[0]
            choice = choose(self.slots, job.request.prompt, job.request.cache_prompt)
            if choice is None:
                return
            self._waiting.popleft()
            if job.cancel_requested.is_set():
                self._ended(job, "cancelled")
                continue
            try:
                self._start(job, choice)
            except Exception as exc:  # noqa: BLE001 - a job that cannot start fails alone
                request = next((r for r, j in self._running.items() if j is job), None)
                self._failed(job, exc, request, choice.slot)

    def _start(self, job: Job, choice) -> None:
        slot, req = choice.slot, job.request
        if choice.checkpoint is not None:
            self.model.state_set(slot.id, choice.checkpoint.data, f"slot {slot.id} checkpoint")
        elif not choice.cached and self.model.seq_pos(slot.id):
            self.model.seq_rm(slot.id)
        self._begin(job, slot, choice.cached)

    def _begin(self, job: Job, slot: Slot, cached: int) -> None:
        req = job.request
        if cached:
            self.stats.cache_hits += 1
            self.stats.cached_tokens += cached
        sampler = Sampler(req.sampling)
        sampler.accept(req.prompt[:cached])  # the penalties see the whole prompt, cached or not
        eog = frozenset() if req.ignore_eos or self._eos is None else frozenset({self._eos})
        show, plan = (lambda _t: True), req.plan
        if req.reply is not None:  # a chat reply: its channels and tool calls parsed as it is sampled
            job.parser = ReplyParser(self.model.tokenizer, req.reply.start, req.reply.tools,
                                     reasoning_in_content=req.reply.reasoning_in_content)
            show, plan = job.parser.feed, req.reply.plan
        constraint = Constraint(plan, self.model.tokenizer) if plan is not None else None
        prompt = req.prompt[cached:] if req.runs is None else req.runs  # with images: runs of ids and rows
        request = self.batch.add(slot.id, prompt, sampler, StopRules(eog, req.max_tokens, req.stop),
                                 show=show, logprobs=req.logprobs, constraint=constraint)
        job.constraint = constraint
        slot.busy, slot.history = True, list(req.prompt[:cached])
        self._running[request] = job
        job.started(slot.id, cached)

    def _step(self) -> None:
        busy = len(self._running)
        try:
            logits = self.batch.feed()
        except Exception as exc:  # noqa: BLE001 - a batch the model refused, non-finite logits, a fault of
            self._fail_running(exc)  # the model's call: the jobs of this step fail, the engine goes on
            return
        self.stats.n_decode += 1
        self.stats.busy_slots += busy
        prompt_done = [r for r in self._running if r.prefilling and not r.todo]
        for request, event in self.batch.sample(logits, self._sample_failed):
            job = self._running[request]
            try:
                job.token(event)
                if event.stop:
                    self._finish(request, event.stop)
            except Exception as exc:  # noqa: BLE001 - its reply parser's or its end's fault: that job's only
                self._failed(job, exc, request)
        for request in prompt_done:  # after the first tokens went out: their latency does not pay for it
            if request in self._running:
                self._checkpoint(request)

    def _checkpoint(self, request: Request) -> None:
        """The slot's state at the end of the prompt (until the next step feeds the sampled token,
        the sequence holds exactly the prompt)."""
        slot, tokens = self.slots[request.seq], self.model.seq_tokens(request.seq)
        if slot.keep and EMBEDDING_POS not in tokens:  # a prompt with images is never reused (server/media.py)
            try:
                slot.remember(Checkpoint(tuple(tokens), self.model.state_get(request.seq)))
            except Exception as exc:  # noqa: BLE001 - a checkpoint only saves work: without it the job goes on
                self._log(f"error: slot {slot.id}: no checkpoint of this prompt ({type(exc).__name__}: {exc})")

    def _finish(self, request: Request, reason: str) -> None:
        job = self._running.pop(request)
        slot = self.slots[request.seq]
        slot.busy, slot.history = False, self.model.seq_tokens(request.seq)
        self._clock += 1
        slot.last_used = self._clock
        result = job.end(reason)
        self._release()
        self._log(f"slot {slot.id}: task {job.id}: prompt {result.prompt_tokens} tokens ({result.cached_tokens} "
                  f"cached), {result.completion_tokens} generated, {result.finish_reason}")

    def _ended(self, job: Job, reason: str) -> None:
        job.end(reason)
        self._release()

    def _sample_failed(self, request: Request, exc: Exception) -> None:
        self._failed(self._running[request], exc, request)

    def _failed(self, job: Job, exc: BaseException, request: Request | None, slot: Slot | None = None) -> None:
        """One job's fault: it ends with an error (its own ApiError, else a 500 naming the
        exception), its slot is freed and emptied (what the slot holds may be half a step), one
        log line; the engine goes on."""
        self._log(f"error: task {job.id}: {type(exc).__name__}: {exc}")
        if request is not None:
            self.batch.cancel(request, "error")
            self._running.pop(request, None)
            slot = self.slots[request.seq]
        if slot is not None:
            self.model.seq_rm(slot.id)
            slot.busy, slot.history = False, []
        job.fail(exc if isinstance(exc, ApiError) else ApiError(500, SERVER, f"{type(exc).__name__}: {exc}"))
        self._release()

    def _release(self) -> None:
        with self._lock:
            self._outstanding -= 1

    def _fail_running(self, exc: BaseException) -> None:
        self._log(f"error: {exc}" if isinstance(exc, KimiError) else f"error: {type(exc).__name__}: {exc}")
        for request, job in list(self._running.items()):
            self.batch.cancel(request, "error")
            self._running.pop(request)
            slot = self.slots[request.seq]
            self.model.seq_rm(slot.id)
            slot.busy, slot.history = False, []
            job.fail(ApiError(500, SERVER, str(exc)))
            self._release()

    def _end_all(self, error: ApiError) -> None:
        for request, job in list(self._running.items()):
            self.batch.cancel(request, "cancelled")
            self._running.pop(request)
            self.slots[request.seq].busy = False
            job.fail(error)
            self._release()
        while self._waiting:
            self._waiting.popleft().fail(error)
            self._release()
        while True:  # what came in after the stop: refuse it too
            try:
                kind, value = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "job":
                value.fail(error)
                self._release()
            elif kind == "slot":
                value[3].set_exception(error)
