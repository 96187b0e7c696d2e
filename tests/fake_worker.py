"""An in-memory worker for in-process tests of the scheduler's Engine (a `WorkerConnection`).

It mirrors what a real worker does with the Step stream and the KV calls, with a
deterministic "model" so token streams can be checked exactly:

- A persistent batch keyed by request id, fed by each plan: `is_new` items bring the
  request's full token list and block table, later items deltas (appended blocks or a
  replaced table); `dropped_request_ids` leave the batch first. A request samples when a
  step computes its last known token (`num_computed_before + num_new_tokens` reaches its
  token count, which includes tokens the worker sampled itself in earlier steps: async
  scheduling plans step N+1 before N's result arrives).
- A KV content model: every block holds, slot by slot, the token ids whose KV was written
  into it. A step writes the tokens it computes into the request's blocks; the sample
  then reads the whole sequence back from the blocks, so a wrong block table, a missed
  transfer, a bad prefix-cache hit or a lost copy-on-write / swap changes the token (and is
  recorded in `kv_errors`). Swap space, block copies and swaps are modelled too.
- A plan's `kv_loads` and a peer's `send_kv` between fakes of one `FakeFabric` move block
  contents under a tag (rendezvous: the send completes when the load took the data). A load
  starts when its plan arrives, writes only once the steps before that plan have executed,
  gives up if its tag was cancelled (by a plan's `cancelled_transfer_tags`, a new step
  stream or a kill), and reports its outcome with the next step result (`kv_loads_done`);
  an `await_kv` plan is answered once a load ends or another plan arrives. Only cancelled
  tags protect the blocks, as in the real protocol.

Test controls: `kill()` / `revive()`, `set_health()`, `step_delay_s`, `hold_steps()` /
`release_steps()`, `hang_transfers()` / `fail_transfers()` / `heal_transfers()` (all
transfers or some tags), `after_kv_received` (a hook run when a receive has written),
`during_send` (a hook awaited inside `send_step` once the plan is queued, before the call
returns: what happens meanwhile happens while the engine awaits its send), `refuse_lora`
(add_lora refuses). LoRA adapters are held by name (`lora_adapters`, those of
its `WorkerInfo` at start and after a revive); a plan that schedules a request on an
adapter it does not hold is a plan error.
What tests read: `steps`, `planned_request_ids`, `batch`, `kv`, `cancelled_tags_received`,
`receive_tags` / `send_tags`, `receives_in_progress`, `kv_errors`, `plan_errors`, `is_idle`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from common.kv_shared_memory import SharedMemoryInfo
from common.sampling import Logprob
from common.step_result import KvLoadDone, StepResult
from services.scheduler.worker_types import (
    ConstraintRefusedError,
    LoraRefusedError,
    ModelShape,
    SpeculativeInfo,
    WorkerInfo,
    WorkerUnavailableError,
)
from tests.fake_kv_fabric import FakeFabric, FakeKvTransfers
from tests.fake_model import VOCAB_SIZE
from tests.fake_steps import FakeRequest, FakeStepExecution, PlanItem, StepPlan, StepRecord


def worker_info(
    worker_id: str,
    role: str = "both",
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    num_swap_blocks: int = 0,
    vocab_size: int = VOCAB_SIZE,
    max_model_len: int = 512,
    num_layers: int = 2,
    shared_memory: bool = False,
    speculative_tokens: int = 0,
    disable_by_batch_size: int = 0,
) -> WorkerInfo:
    """A small worker description (roles 'prefill', 'decode' or 'both'); `shared_memory`:
    its pool can be pulled from by the other shared-memory fakes (one "host")."""
    if role not in ("prefill", "decode", "both"):
        raise ValueError(f"role must be prefill, decode or both, got {role!r}")
    return WorkerInfo(
        worker_id=worker_id,
        address=f"fake-{worker_id}:50000",
        role=role,
        model=ModelShape(
            name="fake",
            architecture="FakeForCausalLM",
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            eos_token_ids=(),
            dtype="float32",
            num_layers=num_layers,
            num_kv_heads=1,
            head_dim=8,
        ),
        num_blocks=num_blocks,
        block_size=block_size,
        block_bytes=64 * block_size,
        ucx_address=f"ucx://{worker_id}".encode(),
        num_swap_blocks=num_swap_blocks,
        shared_memory=SharedMemoryInfo("fake-host", 0, 0, 0, b"") if shared_memory else None,
        speculative=(
            SpeculativeInfo("ngram", speculative_tokens, disable_by_batch_size)
            if speculative_tokens
            else None
        ),
        boot_id=f"{worker_id}#0",
    )


class FakeWorker(FakeStepExecution, FakeKvTransfers):
    """A `WorkerConnection` to an in-memory worker (see the module docstring)."""

    def __init__(self, info: WorkerInfo, fabric: FakeFabric | None = None) -> None:
        self.info = info
        self.address = info.address
        self.fabric = fabric if fabric is not None else FakeFabric()
        self.fabric.workers[info.ucx_address] = self
        # -- test controls
        self.step_delay_s = 0.0
        self.spec_results: dict[int, tuple[dict, dict]] = {}
        self.logprob_results: dict[int, dict[str, Logprob]] = {}
        self.proposed_tokens = 0
        self._health = "SERVING"
        self._killed = False
        self._closed = False
        self._held = False
        self._transfer_fault: str | None = None  # None, "hang" or "fail"
        self._fault_tags: set[int] | None = None  # the tags it applies to (None: all)
        # Awaited by a receive after it wrote its blocks, before it answers (tests use it
        # to make something happen exactly then).
        self.after_kv_received: Callable[[int], Awaitable[None]] | None = None
        # Awaited by send_step with the plan once it is queued, before the call returns.
        self.during_send: Callable[[Any], Awaitable[None]] | None = None
        self.refuse_pulls = False  # a load with a source: the pool cannot be mapped
        self.kv_load_timeout_s = 30.0  # a load's own deadline on the "worker"
        self.refuse_lora: str | None = None  # add_lora refuses, saying this
        # LoRA adapters held (name -> folder; "" for those of its start), like --lora-modules
        self.lora_adapters: dict[str, str] = dict.fromkeys(info.model.lora_adapters, "")
        self.prepared: list = []  # constraints compiled with prepare_structured
        self.prepare_gate: asyncio.Event | None = None  # prepare_structured waits for it
        self.refuse_constraint: str | None = None  # prepare_structured refuses, saying this
        # -- worker state (lost when killed)
        self.batch: dict[str, FakeRequest] = {}
        self.kv: dict[int, list[int | None]] = {}
        self.swap_kv: dict[int, list[int | None]] = {}
        self._incarnation = 0
        self._stream = 0  # 0 = no step stream open
        self._step_id = 0
        self.executed_step_id = 0
        self._plans: deque[StepPlan] = deque()
        self._results: deque[StepResult] = deque()
        self._stream_error: str | None = None
        self._cancelled: set[int] = set()
        self._receives: dict[int, asyncio.Task] = {}
        self._loads_done: list = []  # KvLoadDone, for the next step result
        self._tasks: set[asyncio.Task] = set()
        self._stepper: asyncio.Task | None = None
        # -- what the tests look at
        self.steps: list[StepRecord] = []  # every executed step
        self.planned_request_ids: set[str] = set()  # requests some sent plan scheduled
        self.cancelled_tags_received: list[int] = []  # from plans, in arrival order
        self.receive_tags: list[int] = []  # tags of kv_loads started
        self.send_tags: list[int] = []  # tags of send_kv calls
        self.pull_tags: list[int] = []  # kv_loads that copy from a peer's pool
        self.kv_blocks_received = 0
        self.kv_errors: list[str] = []  # a sample read KV that does not match its tokens
        self.plan_errors: list[str] = []  # plans that do not fit the batch (engine bugs)
        self.num_stream_opens = 0

    # -- test controls ---------------------------------------------------------------------
    @property
    def killed(self) -> bool:
        return self._killed

    def kill(self) -> None:
        """The process is gone: every call raises WorkerUnavailableError, health answers
        UNREACHABLE, calls under way fail, peers' sends to it fail."""
        self._killed = True
        self._incarnation += 1
        self._stream = 0
        self.fabric.notify()

    def revive(self, info: WorkerInfo | None = None) -> None:
        """A fresh process at the same address: SERVING, no batch, no KV, no stream."""
        if info is not None:
            self.info = info
        self._killed = False
        self._health = "SERVING"
        self._incarnation += 1
        self._stream = 0
        self.lora_adapters = dict.fromkeys(self.info.model.lora_adapters, "")
        self.prepared = []
        self._reset_state()
        self.kv.clear()
        self.swap_kv.clear()
        self.fabric.notify()

    def set_health(self, status: str) -> None:
        """'SERVING' or 'NOT_SERVING' (draining: its step results say so too)."""
        self._health = status
        self.fabric.notify()

    def hold_steps(self) -> None:
        """Plans are accepted but no step that computes tokens runs until `release_steps`
        (nor any after it; plans that only move KV or await loads still run)."""
        self._held = True

    def release_steps(self) -> None:
        self._held = False
        self.fabric.notify()

    def hang_transfers(self, tags: Iterable[int] | None = None) -> None:
        """send_kv / KV loads on this worker (only for `tags`, if given) never move data
        until healed, cancelled, killed or past their deadline."""
        self._transfer_fault, self._fault_tags = "hang", None if tags is None else set(tags)
        self.fabric.notify()

    def fail_transfers(self, tags: Iterable[int] | None = None) -> None:
        """send_kv / KV loads on this worker (only for `tags`, if given) fail at once."""
        self._transfer_fault, self._fault_tags = "fail", None if tags is None else set(tags)
        self.fabric.notify()

    def heal_transfers(self) -> None:
        self._transfer_fault, self._fault_tags = None, None
        self.fabric.notify()

    def _faulty(self, tag: int, fault: str) -> bool:
        return self._transfer_fault == fault and (
            self._fault_tags is None or tag in self._fault_tags
        )

    @property
    def is_idle(self) -> bool:
        """No request in the batch, no plan waiting to run, no result unread."""
        return not (self.batch or self._plans or self._results)

    @property
    def receives_in_progress(self) -> list[int]:
        return list(self._receives)

    def block_tokens(self, block_id: int) -> list[int | None]:
        return list(self.kv.get(block_id, [None] * self.info.block_size))

    # -- WorkerConnection ------------------------------------------------------------------
    async def health(self, timeout_s: float) -> str:
        await asyncio.sleep(0)
        return "UNREACHABLE" if self._killed or self._closed else self._health

    async def health_boot(self, timeout_s: float) -> tuple[str, str]:
        status = await self.health(timeout_s)
        return status, "" if status == "UNREACHABLE" else self.boot_id

    @property
    def boot_id(self) -> str:
        """Another one per process: every kill and revive makes a new one."""
        return f"{self.info.worker_id}#{self._incarnation}" if self.info.boot_id else ""

    async def wait_ready(self, timeout_s: float) -> WorkerInfo:
        await asyncio.sleep(0)
        self._check_alive()
        return dataclasses.replace(self.info, boot_id=self.boot_id)

    async def open_step_stream(self) -> None:
        self._check_alive()
        self.close_step_stream()
        self._reset_state()
        self.num_stream_opens += 1
        self._stream = self._incarnation * 1_000_000 + self.num_stream_opens
        stream = self._stream
        self._stepper = self._spawn(self._run_steps(stream))

    def close_step_stream(self) -> None:
        """The worker forgets its batch (a real one resets when its stream ends)."""
        if self._stream:
            self._stream = 0
            self._reset_state()
            self.fabric.notify()

    @property
    def last_sent_step_id(self) -> int:
        """(Tests only: the scheduler no longer asks.)"""
        return self._step_id

    async def send_step(self, plan: Any) -> int:
        """`plan` is a `PoolStepPlan` (read by attribute, copied now: its requests change)."""
        cancelled_transfer_tags = list(plan.cancelled_transfer_tags)
        self._check_alive()
        if not self._stream:
            raise WorkerUnavailableError(f"worker {self.address}: no step stream open")
        self._step_id += 1
        # A real worker cancels the receives when the plan arrives, before it runs.
        self._cancel_transfers(cancelled_transfer_tags)
        self.cancelled_tags_received.extend(cancelled_transfer_tags)
        for load in plan.kv_loads:
            self._start_load(load, self._step_id)
        items = []
        for s in plan.scheduled:
            r = s.request
            if r.lora_name and r.lora_name not in self.lora_adapters:
                self.plan_errors.append(f"{r.request_id}: LoRA {r.lora_name!r} is not held")
            items.append(
                PlanItem(
                    request_id=r.request_id,
                    is_new=s.is_new,
                    token_ids=list(s.work.token_ids) if s.is_new else [],
                    block_ids=list(s.new_block_ids),
                    num_computed_before=s.num_computed_before,
                    num_new_tokens=s.num_new_tokens,
                    replaced_table=list(s.replaced_table) if s.replaced_table else None,
                    num_lookahead_tokens=s.num_lookahead_tokens,
                    num_logprobs=r.sampling.logprobs,
                )
            )
            self.planned_request_ids.add(r.request_id)
        self._plans.append(
            StepPlan(
                step_id=self._step_id,
                items=items,
                dropped=list(plan.dropped_request_ids),
                swap_out=list(plan.swap_out),
                swap_in=list(plan.swap_in),
                copies=list(plan.block_copies),
                cancelled_transfer_tags=list(cancelled_transfer_tags),
                await_kv=plan.only_awaits_kv,
            )
        )
        self.fabric.notify()
        step_id = self._step_id
        if self.during_send is not None:
            await self.during_send(plan)
        await asyncio.sleep(0)
        return step_id

    async def receive_step(self) -> StepResult:
        self._check_alive()
        stream = self._stream
        if not stream:
            raise WorkerUnavailableError(f"worker {self.address}: no step stream open")
        await self._until(
            lambda: bool(self._results) or self._stream_error is not None,
            None,
            "receive_step",
            stream=stream,
        )
        if self._results:
            return self._results.popleft()
        raise WorkerUnavailableError(f"worker {self.address} step failed: {self._stream_error}")

    async def send_kv(
        self, tag: int, peer: WorkerInfo, block_ids: list[int], timeout_s: float
    ) -> KvLoadDone:
        self._check_alive()
        self.send_tags.append(tag)
        task = self._spawn(self._serve_send(tag, peer, list(block_ids), timeout_s))
        return await asyncio.shield(task)

    async def add_lora(self, name: str, path: str, timeout_s: float) -> None:
        self._check_alive()
        if self.refuse_lora is not None:
            raise LoraRefusedError("INVALID_ARGUMENT", self.refuse_lora)
        self.lora_adapters[name] = path

    async def remove_lora(self, name: str, timeout_s: float) -> None:
        self._check_alive()
        self.lora_adapters.pop(name, None)

    async def prepare_structured(self, constraint, timeout_s: float) -> None:
        self._check_alive()
        if self.prepare_gate is not None:
            await self.prepare_gate.wait()
        if self.refuse_constraint is not None:
            raise ConstraintRefusedError(self.refuse_constraint)
        self.prepared.append(constraint)

    async def close(self) -> None:
        self._closed = True
        self._stream = 0
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.fabric.notify()

    # -- internals -----------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._killed:
            raise WorkerUnavailableError(f"worker {self.address} is unreachable (killed)")
        if self._closed:
            raise WorkerUnavailableError(f"connection to {self.address} is closed")

    def _reset_state(self) -> None:
        """A new (or no) step stream: the batch is forgotten, step ids restart, receives
        still waiting are abandoned."""
        self.batch.clear()
        self._plans.clear()
        self._results.clear()
        self._stream_error = None
        self._loads_done.clear()
        self._step_id = 0
        self.executed_step_id = 0
        self._cancel_transfers(list(self._receives))
        if self._stepper is not None:
            self._stepper.cancel()
            self._stepper = None

    def _cancel_transfers(self, tags: Sequence[int]) -> None:
        self._cancelled.update(tags)
        if tags:
            self.fabric.notify()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # an orphaned call's failure is expected: mark it retrieved

    async def _until(
        self,
        predicate: Callable[[], bool],
        deadline: float | None,
        what: str,
        *,
        stream: int | None = None,
        failure: Callable[[], str | None] = lambda: None,
    ) -> None:
        """Wait until `predicate()`; raise WorkerUnavailableError when this worker is killed
        or restarted meanwhile, its step stream `stream` ended, `failure()` names a reason,
        or `deadline` (loop time) passes."""
        incarnation = self._incarnation
        loop = asyncio.get_running_loop()
        while True:
            self._check_alive()
            if self._incarnation != incarnation:
                raise WorkerUnavailableError(f"worker {self.address} restarted during {what}")
            if stream is not None and self._stream != stream:
                raise WorkerUnavailableError(f"worker {self.address}: step stream closed")
            reason = failure()
            if reason is not None:
                raise WorkerUnavailableError(f"worker {self.address}: {what}: {reason}")
            if predicate():
                return
            change = self.fabric.next_change()
            if deadline is None:
                await change.wait()
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise WorkerUnavailableError(f"worker {self.address}: {what} timed out")
            try:
                await asyncio.wait_for(change.wait(), remaining)
            except TimeoutError:
                pass

    # -- steps -----------------------------------------------------------------------------
    async def _run_steps(self, stream: int) -> None:
        """Run the plans of one step stream in order, back to back."""
        try:
            while True:
                await self._until(
                    lambda: bool(self._plans) and not (self._held and self._plans[0].items),
                    None,
                    "step",
                    stream=stream,
                )
                started = time.perf_counter()
                if self.step_delay_s:
                    await asyncio.sleep(self.step_delay_s)
                    if self._killed or self._stream != stream:
                        return
                plan = self._plans.popleft()
                try:
                    result = self._execute(plan)
                except ValueError as exc:  # the real worker aborts the stream
                    self.plan_errors.append(f"step {plan.step_id}: {exc}")
                    self._stream_error = f"FAILED_PRECONDITION {exc}"
                    self.fabric.notify()
                    return
                if plan.await_kv:  # until a load ends or another plan comes
                    await self._until(
                        lambda: bool(self._loads_done or self._plans or not self._receives),
                        None,
                        "await_kv",
                        stream=stream,
                    )
                accepted, spec = self.spec_results.pop(plan.step_id, ({}, {}))
                done, self._loads_done = tuple(self._loads_done), []
                self._results.append(
                    StepResult(
                        step_id=plan.step_id,
                        sampled=result,
                        execute_seconds=time.perf_counter() - started,
                        logprobs=self.logprob_results.pop(plan.step_id, {}),
                        spec=spec,
                        draining=self._health == "NOT_SERVING",  # as a real worker says
                        kv_loads_done=done,
                    )
                )
                self.executed_step_id = plan.step_id
                self.fabric.notify()
        except WorkerUnavailableError:
            return


def make_workers(*infos: WorkerInfo) -> list[FakeWorker]:
    """Fakes for these workers, connected to each other through one new fabric."""
    fabric = FakeFabric()
    return [FakeWorker(info, fabric) for info in infos]
