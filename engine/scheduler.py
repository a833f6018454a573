"""Continuous batching with one token budget per step (vLLM V1's scheduler, written small).

Each step, running requests are served first (decodes and unfinished prefill chunks), then waiting
requests are admitted while the budget, `max_num_seqs` and free KV blocks allow. A request has no
"phase": it simply has `num_tokens - num_computed_tokens` tokens left to compute, so decodes and
prefill chunks share a batch. When a running request cannot get a block, the lowest-priority (newest)
running request is preempted: its blocks are freed and it is recomputed later.

The scheduler also keeps the prefill backlog (`PrefillBacklog`, exported as `kvgate:num_prefill_tokens_pending`,
what a router weighs): the sum of `prefill_tokens_pending(r)` over every waiting and running request, kept exact by
adjusting it wherever a request's computed tokens, tokens or queue change, so reading it never walks the queues.

Scheduling a chunk advances the request's `num_computed_tokens` at once (vLLM V1's order), and a chunk that samples
adds an output placeholder that the step's update replaces with the token. With async scheduling (vLLM's
`--async-scheduling`) the engine schedules the next step before the running step's tokens reach the host: a
decode then computes a placeholder, whose id the runner takes from the running step's sampled ids on the device.
A request whose running step may end it is scheduled anyway (stop strings and EOS are known only on the host); the
token such a step samples for it is dropped. One that will surely end (max_tokens, the context length) is not.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from kvgate.engine.block_table import BlockTable
from kvgate.common.errors import LoRAError
from kvgate.engine.kv_cache_manager import KVCacheManager
from kvgate.engine.lora.manager import LoRAManager
from kvgate.engine.request import Request, RequestStatus
from kvgate.engine.spec_decode import DraftBackoff, SpecDecodeStats, speculation_eligible


def prefill_tokens_pending(request: Request) -> int:
    """Tokens whose K/V the engine must still compute before this request decodes again.

    A request that has produced no token yet: its prompt tokens not yet computed (after admission, tokens the
    prefix cache supplied count as computed; while it waits for admission, those the cache held when it arrived).
    One that has (a preempted request being recomputed): its prompt and output tokens not yet computed, less the
    last output token, which is its next decode token. A request that is decoding has 0.

    Why the cache at arrival counts for a waiting request: a router weighs this backlog as the work between a new
    request and its first token (the EPP's affinity filter leaves a warm replica when it is too long). Counting a
    waiting request's prompt whole would report the tokens its cached prefix already holds as work to do, so a replica
    serving one tenant's mostly cached prompts would look far busier than it is.
    """
    decode = 1 if request.output_token_ids or request.num_output_placeholders else 0
    computed = request.num_computed_tokens
    if request.status == RequestStatus.WAITING:
        computed = max(computed, request.num_cached_on_arrival)
    return max(request.num_tokens + request.num_output_placeholders - computed - decode, 0)


def samples_from_host_state(request: Request) -> bool:
    """Its sampling reads its earlier output on the host (a grammar's mask), so its steps cannot be scheduled
    before the step before them has returned its token (no async scheduling). Penalties read token counts kept on
    the device (penalty_state.py) and do not."""
    p = request.sampling_params  # a request has a grammar exactly when it asks for structured outputs
    return p.structured_outputs is not None


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_row: int  # the request's row of SchedulerOutput.block_table (its block ids)
    start: int = 0  # the request's computed tokens before this chunk: the chunk is tokens [start, start + new)
    samples: bool = False  # the chunk reaches the end of the request's tokens, so a token is sampled
    # Speculative decoding: draft tokens computed after the request's last token in this chunk (num_new_tokens
    # counts them); the step verifies them and returns the accepted ones plus one (spec_decode.py).
    draft: list[int] | None = None
    draft_probs: object | None = None  # [len(draft), V]: the q each draft was sampled from (a draft model's)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Every request's block ids, one row each (the KV cache manager's): read them right after scheduling, before
    # the next schedule() reuses the rows of requests that ended.
    block_table: BlockTable | None = None
    preempted: list[Request] = field(default_factory=list)
    lora_slots: dict[int, int] = field(default_factory=dict)  # adapter id -> runner slot, for this step's batch
    # Requests ended with an error while scheduling (an adapter whose files could not be read again): the engine
    # reports them to their callers (LLMEngine.take_failures).
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    has_drafts: bool = False  # some request carries draft tokens (speculative decoding)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class FCFSQueue:
    """First come, first served; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._fifo: deque[Request] = deque()

    def add(self, request: Request, front: bool = False) -> None:
        if front:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def peek(self) -> Request:
        return self._fifo[0]

    def pop(self) -> Request:
        return self._fifo.popleft()

    def remove(self, request: Request) -> None:
        self._fifo.remove(request)

    def __len__(self) -> int:
        return len(self._fifo)

    def __iter__(self):
        return iter(self._fifo)


class PriorityQueue:
    """By (priority, arrival): a lower priority value is served first (vLLM's convention); ties in arrival order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, request: Request, front: bool = False) -> None:  # a preempted request keeps its place by key
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._seq), request))

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (e[3] for e in self._heap)


WAITING_QUEUES = {"fcfs": FCFSQueue, "priority": PriorityQueue}


class PrefillBacklog:
    """The sum of prefill_tokens_pending() over the scheduler's waiting and running requests (the one place it is
    kept): a request counts from add() to remove(), and every change to one that it counts for is made inside
    `with backlog.change(request):`, which adds the difference. O(1) a change, where a recount would walk every
    request each time the backlog is read."""

    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = 0

    def add(self, request: Request) -> None:
        self.total += prefill_tokens_pending(request)

    def remove(self, request: Request) -> None:
        self.total -= prefill_tokens_pending(request)

    def change(self, request: Request) -> _BacklogChange:
        return _BacklogChange(self, request)


class _BacklogChange:
    """`with PrefillBacklog.change(request):` the request's backlog before the block, the difference added after."""

    __slots__ = ("backlog", "request", "before")

    def __init__(self, backlog: PrefillBacklog, request: Request) -> None:
        self.backlog, self.request = backlog, request

    def __enter__(self) -> None:
        self.before = prefill_tokens_pending(self.request)

    def __exit__(self, *exc) -> None:
        self.backlog.total += prefill_tokens_pending(self.request) - self.before


@dataclass(eq=False)
class _Batch:
    """What one schedule() call has chosen so far: each request's chunk, the drafts after it, the budget left."""

    out: SchedulerOutput
    budget: int  # tokens still free in this step's batch
    chunks: dict[str, int] = field(default_factory=dict)  # request id -> tokens scheduled this step
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request id -> draft tokens after its last token
    draft_probs: dict[str, object] = field(default_factory=dict)  # request id -> q of a draft model's drafts

    def take(self, request: Request, num_new: int, draft: list[int] | None = None) -> None:
        self.chunks[request.request_id] = num_new
        if draft:
            self.drafts[request.request_id] = draft
        self.budget -= num_new

    def give_back(self, request: Request) -> None:
        """A request taken earlier in this step was preempted: its chunk's tokens are free again."""
        self.budget += self.chunks.pop(request.request_id)
        self.drafts.pop(request.request_id, None)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        policy: str = "fcfs",
        lora: LoRAManager | None = None,
        proposer=None,
        spec_stats: SpecDecodeStats | None = None,
        draft_backoff: DraftBackoff | None = None,
    ) -> None:
        self.kv = kv_cache_manager
        # spec_decode.Proposer (n-grams or a draft model): drafts for decoding requests; None = no speculation
        self.proposer = proposer
        self.spec_stats = spec_stats  # counts drafts and accepted tokens when speculating
        self.draft_backoff = draft_backoff  # pauses drafting for requests whose drafts keep being rejected
        self.lora = lora  # with LoRA on: a waiting request is admitted only once its adapter holds a slot
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        # vLLM's --long-prefill-token-threshold: a prefill computes at most this many tokens a step (0: up to the
        # budget), so a long cold prompt no longer holds every other request's first token for its whole prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        if policy not in WAITING_QUEUES:
            raise ValueError(f"unknown scheduling policy {policy!r} (fcfs or priority)")
        self.policy = policy
        self.waiting = WAITING_QUEUES[policy]()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.backlog = PrefillBacklog()
        self.num_host_bound = 0  # unfinished requests for which samples_from_host_state is true

    # -- queue management -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        request.status = RequestStatus.WAITING
        # Hashes the prompt's blocks now, kept on the request, so admission's lookup only repeats the table lookups;
        # what the cache holds now is also what the backlog leaves out while the request waits.
        request.num_cached_on_arrival = self.kv.get_computed_blocks(request)[1]
        self.requests[request.request_id] = request
        self.waiting.add(request)
        self.backlog.add(request)
        self.num_host_bound += samples_from_host_state(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (stop string, abort) a request wherever it is; frees its blocks."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._remove(request, running=request.status == RequestStatus.RUNNING)
        request.status = status
        return request

    def _remove(self, request: Request, running: bool) -> None:
        """Take an ending request out of the scheduler (its queue, the backlog) and free its blocks."""
        self.requests.pop(request.request_id, None)
        self.backlog.remove(request)
        self.num_host_bound -= samples_from_host_state(request)
        if running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_prefill_tokens_pending(self) -> int:
        return self.backlog.total

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """One step's batch: running requests first, then waiting ones while the budget, max_num_seqs and free KV
        blocks allow; each chosen chunk then advances its request (the module docstring says how)."""
        batch = _Batch(SchedulerOutput(block_table=self.kv.block_table), self.max_num_batched_tokens)
        self._schedule_running(batch)
        self._fill_drafts(batch)
        self._admit_waiting(batch)
        self._advance_scheduled(batch)
        return batch.out

    def _schedule_running(self, batch: _Batch) -> None:
        """Running requests, oldest first, each with its chunk allocated (or preempted, with what it displaced)."""
        i = 0  # running[i] is the next to schedule; a preempted request before it moves it back one
        allocate = self.kv.allocate_slots
        while i < len(self.running) and batch.budget > 0:
            request = self.running[i]
            placeholders = request.num_output_placeholders
            if placeholders and len(request.output_token_ids) + placeholders >= request.output_limit:
                i += 1  # async scheduling: the tokens its queued steps sample end it (max_tokens, context length)
                continue
            num_new, draft = self._running_chunk(request, batch.budget)
            num_unscheduled = 0
            if allocate(request, num_new) is None:
                num_new, draft, num_unscheduled = self._make_room(request, num_new, draft, batch)
                if request.status != RequestStatus.RUNNING:
                    break  # it preempted itself: nothing else fits this step
            batch.take(request, num_new, draft)
            i += 1 - num_unscheduled

    def _running_chunk(self, request: Request, budget: int) -> tuple[int, list[int] | None]:
        """A running request's chunk: the tokens it has not computed (with draft slots after a decode's token when
        it speculates), a prefill's capped by long_prefill_token_threshold, all within the budget."""
        num_new = len(request.all_token_ids) + request.num_output_placeholders - request.num_computed_tokens
        draft = self._reserve_draft(request, budget) if num_new == 1 and self.proposer is not None else None
        if draft:
            num_new += len(draft)
        elif 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        return min(num_new, budget), draft

    def _reserve_draft(self, request: Request, budget: int) -> list[int] | None:
        """The proposer's phase one (spec_decode.Proposer) for a decode: its draft slots, or None. Drafts past
        max_tokens or the budget would be computed for nothing. Adaptive drafting (draft_backoff) holds back a
        request whose drafts keep being rejected: they would cost K positions a step for nothing; outputs are the
        same either way."""
        if (request.num_output_placeholders or not speculation_eligible(request)
                or (self.draft_backoff is not None and not self.draft_backoff.allows(request))):
            return None
        limit = min(budget, request.output_limit - request.num_output_tokens) - 1
        return self.proposer.reserve(request, limit) or None

    def _make_room(self, request: Request, num_new: int, draft: list[int] | None, batch: _Batch
                   ) -> tuple[int, list[int] | None, int]:
        """The chunk's slots are not free: its drafts go first (a plain decode before anyone is preempted), then the
        lowest-priority running requests, until its slots are allocated or it is preempted itself. Returns the
        chunk's (tokens, drafts) and how many requests this step had already scheduled were preempted."""
        num_unscheduled = 0
        while True:
            if draft:
                draft, num_new = None, 1
            else:
                victim = self._pick_victim()
                if victim.request_id in batch.chunks:  # already scheduled this step (priority policy)
                    batch.give_back(victim)
                    num_unscheduled += 1
                self._preempt(victim)
                batch.out.preempted.append(victim)
                if victim is request:
                    return num_new, draft, num_unscheduled
            if self.kv.allocate_slots(request, num_new) is not None:
                return num_new, draft, num_unscheduled

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        with self.backlog.change(victim):
            victim.num_computed_tokens = 0
            victim.num_output_placeholders = 0  # a queued step's token for it is appended as it comes
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(victim, front=True)

    def _fill_drafts(self, batch: _Batch) -> None:
        """The proposer's phase two, for all of the step's drafting requests at once, their chunks sized and
        allocated (a draft model drafts here, into slots those chunks cover; n-gram drafts are already made)."""
        if not batch.drafts:
            return
        ids = list(batch.drafts)
        proposed = self.proposer.fill([self.requests[rid] for rid in ids], [batch.drafts[rid] for rid in ids],
                                      self.kv.block_table)
        for rid, (tokens, q) in zip(ids, proposed):
            batch.drafts[rid] = tokens
            if q is not None:
                batch.draft_probs[rid] = q

    def _admit_waiting(self, batch: _Batch) -> None:
        """Waiting requests in the queue's order, unless this step had to preempt (memory is tight). One whose
        adapter cannot get a slot (all hold adapters with running requests) waits without holding up those behind
        it."""
        if self.lora is not None and self.lora.retired:
            self.lora.drop_retired(self.adapters_in_use())
        if batch.out.preempted:
            return
        skipped: list[Request] = []
        while len(self.waiting) and batch.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.lora_request is not None and not self._adapter_resident(request, batch, skipped):
                continue
            if not self._admit(request, batch):
                break
        for request in reversed(skipped):  # back in their places
            self.waiting.add(request, front=True)

    def _adapter_resident(self, request: Request, batch: _Batch, skipped: list[Request]) -> bool:
        """Whether the waiting request's adapter holds a runner slot (loading it into one if it can). If not, the
        request is set aside in `skipped`, or ended (batch.out.failed) when its adapter no longer loads."""
        in_use = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        try:
            slot = self.lora.make_resident(request.lora_request, in_use)
        except LoRAError as exc:  # its host copy was dropped and its folder no longer loads
            self.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
            batch.out.failed.append((request, exc))
            return False
        if slot is None:
            skipped.append(self.waiting.pop())
            return False
        return True

    def _admit(self, request: Request, batch: _Batch) -> bool:
        """Move the waiting request at the queue's head to running with its first chunk after its cached prefix;
        False (it stays) when the chunk does not fit the budget without chunked prefill, or its blocks are not free."""
        hit_blocks, num_hit = self.kv.get_computed_blocks(request)
        num_new = request.num_tokens - num_hit
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        if num_new > batch.budget and not self.enable_chunked_prefill:
            return False
        num_new = min(num_new, batch.budget)
        if self.kv.allocate_slots(request, num_new, hit_blocks, num_hit) is None:
            return False
        self.waiting.pop()
        if request.num_preemptions == 0:
            self.kv.record_prefix_query(request.num_tokens, num_hit)
            request.num_cached_tokens = num_hit
        with self.backlog.change(request):
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
        self.running.append(request)
        batch.take(request, num_new)
        return True

    def _advance_scheduled(self, batch: _Batch) -> None:
        """The batch's ScheduledRequests in running order, each request advanced past its chunk, and the runner
        slots of their adapters."""
        out, rows = batch.out, self.kv.block_table.row_of
        for request in self.running:
            num_new = batch.chunks.get(request.request_id)
            if num_new is None:
                continue
            draft = batch.drafts.get(request.request_id)
            start, samples = self._advance(request, num_new, draft)
            out.scheduled.append(ScheduledRequest(request, num_new, rows[request.request_id], start, samples, draft,
                                                  batch.draft_probs.get(request.request_id)))
            if request.lora_request is not None:
                lora_id = request.lora_request.lora_int_id
                out.lora_slots[lora_id] = self.lora.slot_of(lora_id)
        out.has_drafts = bool(batch.drafts)

    def _advance(self, request: Request, num_new: int, draft: list[int] | None) -> tuple[int, bool]:
        """Advance the request's computed tokens past its chunk, with a placeholder for the token the chunk samples
        (one that carries drafts always samples: its last token and the drafts, rolled back to what is accepted in
        update_from_output). Returns (the chunk's start, whether it samples)."""
        start = request.num_computed_tokens
        samples = draft is not None or start + num_new == len(request.all_token_ids) + request.num_output_placeholders
        if draft is None and num_new == 1 and samples and (request.output_token_ids or request.num_output_placeholders):
            # A decode (one token after earlier output) has no prefill backlog before or after: the common case of a
            # full batch skips the bookkeeping.
            request.num_computed_tokens = start + 1
            request.num_output_placeholders += 1
            return start, samples
        with self.backlog.change(request):
            request.num_computed_tokens = start + num_new
            if samples:
                request.num_output_placeholders += 1
        return start, samples

    # -- after a step -----------------------------------------------------------------------------

    def adapters_in_use(self) -> set[int]:
        """Ids of the adapters of every unfinished request."""
        return {r.lora_request.lora_int_id for r in self.requests.values() if r.lora_request is not None}

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """(names of adapters with running requests, names of adapters with waiting requests), as vLLM reports."""
        running = {r.lora_request.lora_name for r in self.running if r.lora_request is not None}
        waiting = {r.lora_request.lora_name for r in self.waiting if r.lora_request is not None}
        return sorted(running), sorted(waiting)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Put the sampled tokens in place of their placeholders and finish the requests that ended
        (Request.check_stop decides: the one place); returns requests that got a token. A token for a request that
        ended after the step was scheduled is dropped. One for a request preempted since (async scheduling) is
        kept: it was sampled from the request's whole context before its blocks were freed, and dropping it would
        make a seeded request draw that token again from its advanced generator."""
        progressed = []
        RUNNING, FINISHED = RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED
        for s in out.scheduled:
            request = s.request
            if not s.samples or request.status >= FINISHED:
                continue
            token = sampled[request.request_id]  # a runner samples every row whose chunk samples
            progressed.append(request)
            if s.draft is not None:
                self._update_speculated(s, token)
                continue
            request.num_step_tokens = 1
            running = request.status == RUNNING
            if running:
                request.num_output_placeholders -= 1
                request.output_token_ids.append(token)  # in place of its placeholder: the backlog does not change
                request.all_token_ids.append(token)
            else:  # preempted while the step ran: one more token to recompute
                with self.backlog.change(request):
                    request.append_output_token(token)
            if request.check_stop():
                self._remove(request, running)
        return progressed

    def _update_speculated(self, s: ScheduledRequest, tokens: list[int]) -> None:
        """A speculating request's step: `tokens` are its accepted drafts and the target's next token. Its computed
        tokens go back to what was accepted (the rejected drafts' K/V are garbage, overwritten when those positions
        are computed for real), the blocks that held only rejected positions are freed, and the tokens are appended
        one by one up to the first that ends it. Speculation runs with synchronous scheduling, so the request is
        still running: nothing was scheduled between its step and this update."""
        request = s.request
        accepted = len(tokens) - 1
        if self.spec_stats is not None:
            self.spec_stats.record(len(s.draft), accepted)
        if self.draft_backoff is not None:
            self.draft_backoff.record(request, accepted)
        finished = False
        with self.backlog.change(request):
            request.num_output_placeholders -= 1
            request.num_computed_tokens -= len(s.draft) - accepted
            for n, token in enumerate(tokens, start=1):
                request.append_output_token(token)
                if request.check_stop():
                    finished = True
                    break
            request.num_step_tokens = n
        if finished:
            self._remove(request, running=True)
        else:
            self.kv.trim(request, request.num_tokens)
