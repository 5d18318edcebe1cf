"""The event engine: runs every rank's compiled list in simulated time, hosts and links."""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Callable

from pipefb.errors import ScheduleError
from pipefb.plan.plan import Plan
from pipefb.plan.stashpath import fences_sends
from pipefb.schedule import Action, Kind, Schedule, iteration
from pipefb.sim.cluster import Link
from pipefb.sim.copylane import CopyLane
from pipefb.sim.costmodel import COMPUTE, SENDS, STORE_KINDS, Costs
from pipefb.sim.hosts import Host, Job
from pipefb.sim.memorymodel import RankMemory
from pipefb.sim.program import Op, Program
from pipefb.sim.result import Record
from pipefb.sim.tierslots import tier_slots

_TIMER = -2  # the rank field of a heap entry that runs a callback of `Engine.timers`
_PREFETCH_AFTER = frozenset({Kind.RECV_L, Kind.RECV_B})  # receives a backward rank's
# prefetch waits for ([Note: copy lane] in pipefb.sim.copylane)
_PREFETCH = -10  # a waiter at or below it is rank (_PREFETCH - waiter)'s pending prefetch


# [Note: flush]
# A rank ends each step by waiting until every transfer it sent has left
# (`Transport.flush`: the caller may reuse those tensors after it), so its next iteration
# starts no earlier than that: on a link, when its last byte is sent (latency not
# included); on a loopback host, when the transfer's CPU job ends (the hand-off is work of
# both processes, so it leaves as it arrives). This binds where a step ends with a send: a
# backward-only worker's PUSH_W of the new weights after its OPT. The flush also waits
# for the step's stash writes on the copy lane ([Note: copy lane] in pipefb.sim.copylane).
#
# [Note: step calls]
# Each step of each worker is a Step call from the coordinator (`coordinator.stepping`):
# the coordinator's end (the call, its reply parsed, the step's report) and the worker's
# (its reply built and sent) cost CPU outside any action. On a loopback host the
# coordinator runs there too, so the simulator starts a job of `Cluster.step_cpu` seconds
# on the host beside each rank's first action of an iteration (the next call is already
# waiting on the worker: the CPU overlaps the step, while `step_overhead` is the gap the
# rank itself waits). The calibration measures the call on both ends.
#
# [Note: busy senders]
# A worker's gRPC threads hand its sends on under its process's Python lock (the GIL).
# When the worker computes right after a send, torch drops and retakes that lock around
# each operator, and CPython asks a holder to let go only after a switch interval in which
# the lock never changed hands, so a waiting thread can wait out the whole compute. A
# receiver that computes instead does not delay the hop, and another switch interval does
# not shorten the wait. On a loopback host the simulator starts such a transfer
# `Cluster.busy_send` later (the calibration's mean extra delay), or when that compute
# would end at full speed if sooner; an early send ([Note: early sends] in
# pipefb.sim.program) is followed by its B's weight halves. A step's last sends are not:
# its flush waits, the lock free, until they left.
#
# [Note: fenced sends]
# A PipeFB forward rank's transfers leave only after the stashes it handed over before
# them are written ([Note: copy lane] in pipefb.sim.copylane): the wait runs on the
# hop's writer thread to a worker of its own host, on its gRPC stream's to one elsewhere
# (`GrpcTransport.fence_sends`, [Note: local hops] in dataplane/localhop.py), and the
# transfer then crosses the link between the two workers (`Cluster.link`) as any other.


class Engine:
    """The event loop: each rank runs its unrolled list; an action starts when the rank is
    free and its inputs have arrived (see [Note: shared hosts] in pipefb.sim.hosts)."""

    def __init__(self, plan: Plan, costs: Costs, schedule: Schedule, iterations: int
                 ) -> None:
        self.plan, self.costs, self.cluster = plan, costs, costs.cluster
        self.memory = {r: RankMemory(costs, r, plan.staleness) for r in schedule}
        self.program = Program(schedule, costs, self.memory, plan.staleness,
                               plan.stale_microbatches)
        index = self.program.index
        self.runs = {r: [(k, step, index[r][a]) for k in range(iterations)
                         for step, a in iteration(actions, k, iterations)]
                     for r, actions in schedule.items()}
        self.stride = max(1, self.program.n_keys)
        self.pos = dict.fromkeys(self.runs, 0)
        self.free = dict.fromkeys(self.runs, 0.0)
        self.reached = dict.fromkeys(self.runs, 0.0)  # when the rank got to its next action
        self.avail: dict[int, float] = {}  # step * stride + key -> when consumers may use it
        self.links: dict[tuple[int, int], float] = defaultdict(float)
        self.link_of: dict[tuple[int, int], Link] = {}
        self.host = {r: self.cluster.cores_of(r) for r in self.runs}
        self.hosts = {name: Host(n, self.cluster.oversubscribed_of(name))
                      for name, n in self.host.values()}
        self.waiting: dict[int, list[int]] = defaultdict(list)
        # [Note: flush]: a rank's transfers still on their way, and when the last left
        self.sending: dict[int, int] = defaultdict(int)
        self.flushed: dict[int, float] = defaultdict(float)
        self.flushing: set[int] = set()  # ranks whose next step waits for those transfers
        self.heap: list[tuple[float, int, int, str, int]] = []
        self.timers: dict[int, Callable[[float], None]] = {}  # by heap sequence number
        self.records: list[Record] = []
        self.seq = 0
        # [Note: copy lane]: each rank's lane; forward ranks whose sends wait for their
        # writes ([Note: fenced sends]); per rank the iteration and end of its last FETCH,
        # and when its last receive arrived; when each stash's write ends, by its slot in
        # `avail`
        t = costs.topology
        self.lanes = {r: CopyLane(costs.copy_links[r], self.cluster.stash_in_flight_bytes)
                      for r in self.runs}
        self.fenced = {r: fences_sends(t, r) for r in self.runs}
        self.fetched: dict[int, tuple[int, float]] = {}
        self.arrived: dict[int, float] = {}
        self.written: dict[int, float] = {}
        # on a loopback host a prefetch's take runs when it is issued, so that its CPU job
        # starts then: per rank the (iteration, position, earliest issue) of the one
        # waiting for its inputs, and by (rank, position) when each take issued ends
        self.eager = {r for r in self.runs if self.host[r][0] in self.cluster.loopback_hosts}
        self.pending: dict[int, tuple[int, int, float]] = {}
        self.taken: dict[tuple[int, int], float] = {}
        # a private rank's stashes in the node-local tier ([Note: tier cap])
        self.slots = tier_slots(costs, schedule, self.program.runs_weights)

    def shared(self) -> bool:
        """Whether some host has fewer cores than ranks, or moves bytes on its cores, or
        some ranks' stashes share a capped tier ([Note: tier cap])."""
        on: dict[str, int] = defaultdict(int)
        for name, _ in self.host.values():
            on[name] += 1
        return self.slots.shared or any(on[name] > host.cores
                                        or name in self.cluster.loopback_hosts
                                        for name, host in self.hosts.items())

    def run(self) -> None:
        """Runs every rank's unrolled list to its end (ScheduleError: a deadlock)."""
        if self.shared():
            self._run_in_time_order()
        else:
            self._run_greedy()
        stuck = {r: self.runs[r][p] for r, p in self.pos.items() if p < len(self.runs[r])}
        if stuck:
            raise self._deadlock(stuck)

    def _run_greedy(self) -> None:
        """Without shared hosts, each rank's actions only wait for their inputs, and links
        carry one sender's transfers in that sender's order: every rank may run ahead as
        far as its inputs allow, in any order, and the times come out the same."""
        ops, runs = self.program.ops, self.runs
        ready_ranks = list(self.runs)
        while ready_ranks:
            r = ready_ranks.pop()
            run, rank_ops = runs[r], ops[r]
            while self.pos[r] < len(run):
                p = self.pos[r]
                k, step, i = run[p]
                op = rank_ops[i]
                missing, ready = self._missing(step, op)
                if missing >= 0:
                    self.waiting[missing].append(r)
                    break
                start = max(self._reach(r, p == 0 or run[p - 1][0] != k), ready)
                ready_ranks += self._execute(r, k, step, op, start, schedule=False)

    def _run_in_time_order(self) -> None:
        """Events in time order: a rank's next action may start, or a host's job ends."""
        for r in self.runs:
            self._schedule(r)
        ops = self.program.ops
        while self.heap:
            t, seq, r, name, version = heapq.heappop(self.heap)
            if r == _TIMER:
                self.timers.pop(seq)(t)
                continue
            if r < 0:
                host = self.hosts[name]
                if version == host.version:
                    host.advance(t)
                    for on_finish in host.finished():
                        on_finish(t)
                    self._host_changed(name)
                continue
            p = self.pos[r]
            k, step, i = self.runs[r][p]
            op = ops[r][i]
            if p == 0 or self.runs[r][p - 1][0] != k:
                self._step_calls(r, t)
            if op.lane_bytes:  # the copy lane's: see _lane
                self._execute(r, k, step, op, t)
                continue
            self.free[r] = math.inf  # busy until the job ends
            seconds, through_store = self._seconds(r, step, op)
            if op.tail:  # [Note: early sends]: sends, then the rest as a second job
                self._start_job(self.host[r][0], t, seconds - op.tail,
                                self._sender(r, k, step, op, t))
            else:
                self._start_job(self.host[r][0], t, seconds,
                                self._finisher(r, k, step, op, t))
            if through_store:
                self._store_side(r, t, seconds - self.cluster.action_overhead)

    def _finisher(self, r: int, k: int, step: int, op: Op, start: float
                  ) -> Callable[[float], None]:
        def on_finish(end: float) -> None:
            self._finish(r, k, step, op, start, end)
        return on_finish

    def _sender(self, r: int, k: int, step: int, op: Op, start: float
                ) -> Callable[[float], None]:
        def on_sent(at: float) -> None:
            for waiter in self._send(r, step, op, at):
                self._schedule(waiter)

            def on_finish(end: float) -> None:
                self._finish(r, k, step, op, start, end, sent=True)
            self._start_job(self.host[r][0], at, op.tail, on_finish)
        return on_sent

    def _start_job(self, name: str, t: float, work: float,
                   on_finish: Callable[[float], None]) -> None:
        host = self.hosts[name]
        host.advance(t)
        host.jobs.append(Job(work, on_finish))
        self._host_changed(name)

    def _host_changed(self, name: str) -> None:
        host = self.hosts[name]
        host.version += 1
        if host.jobs:
            self.seq += 1
            heapq.heappush(self.heap, (host.next_finish(), self.seq, -1, name, host.version))

    def _step_calls(self, r: int, t: float) -> None:
        """The CPU of rank `r`'s Step call on a loopback host, beside its first action
        ([Note: step calls])."""
        name = self.host[r][0]
        if self.cluster.step_cpu > 0 and name in self.cluster.loopback_hosts:
            self._start_job(name, t, self.cluster.step_cpu, _nothing)

    def _seconds(self, r: int, step: int, op: Op) -> tuple[float, bool]:
        """Compute-lane seconds of `op` on rank `r`, and whether it moves a stash through
        the store there: a STASH written on the compute lane, or a private rank's stash
        past the tier's cap, whose STASH and FETCH pay the store's time for the tier's
        ([Note: tier cap] in pipefb.sim.tierslots)."""
        if not op.tier_bytes:
            return op.seconds, op.action.kind in STORE_KINDS and r not in self.costs.on_compute
        key = (step, op.microbatch)
        if (self.slots.put(r, key, op.tier_bytes) if op.action.kind is Kind.STASH
                else self.slots.take(r, key)):
            return op.seconds, False
        return self.cluster.action_overhead + self.cluster.store.seconds(op.tier_bytes), True

    def _store_side(self, r: int, t: float, seconds: float) -> None:
        """The local Redis's share of a STASH or FETCH on a loopback host."""
        name = self.host[r][0]
        if name in self.cluster.loopback_hosts:
            self._other_end(name, t, self.lanes[r].link, seconds)

    def _other_end(self, name: str, t: float, link: Link, seconds: float) -> None:
        """Beside a transfer of `seconds` on host `name`, a job of (link.cpu - 1) times that
        work: the other end's share of the cores ([Note: shared hosts])."""
        if link.cpu > 1.0:
            self._start_job(name, t, (link.cpu - 1.0) * max(0.0, seconds), _nothing)

    def _push(self, t: float, r: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, r, "", 0))

    def _after(self, t: float, callback: Callable[[float], None]) -> None:
        """Runs `callback(t)` at time `t`."""
        self.seq += 1
        self.timers[self.seq] = callback
        heapq.heappush(self.heap, (t, self.seq, _TIMER, "", 0))

    def _busy_send(self, r: int, op: Op) -> float:
        """How much later rank `r`'s transfers from `op` start on a loopback host: the
        compute right after them holds the sender's Python lock ([Note: busy senders])."""
        if self.cluster.busy_send <= 0:
            return 0.0
        if op.tail:  # an early send: the B's weight halves follow
            return min(self.cluster.busy_send, op.tail)
        run, ops, p = self.runs[r], self.program.ops[r], self.pos[r] + 1
        while p < len(run) and ops[run[p][2]].action.kind in SENDS:
            p += 1  # further sends only queue their bytes
        if p == len(run) or run[p][0] != run[self.pos[r]][0]:
            return 0.0  # the step ends: its flush waits, the lock free, until they left
        after = ops[run[p][2]]
        return min(self.cluster.busy_send, after.seconds) if after.action.kind in COMPUTE else 0.0

    def _missing(self, step: int, op: Op) -> tuple[int, float]:
        """The first awaited key not yet available (-1: none) and when all are."""
        ready = 0.0
        for offset, key in op.needs:
            at = step + offset
            if at < 0:
                continue
            when = self.avail.get(at * self.stride + key)
            if when is None:
                return at * self.stride + key, 0.0
            ready = max(ready, when)
        return -1, ready

    def _schedule(self, r: int) -> None:
        if r <= _PREFETCH:
            self._try_prefetch(_PREFETCH - r)
            return
        p = self.pos[r]
        if p >= len(self.runs[r]):
            return
        k, step, i = self.runs[r][p]
        missing, ready = self._missing(step, self.program.ops[r][i])
        if missing >= 0:
            self.waiting[missing].append(r)
            return
        first = p == 0 or self.runs[r][p - 1][0] != k
        if first and self.sending[r]:
            self.flushing.add(r)  # the step's flush: the last arrival schedules it again
            return
        self._push(max(self._reach(r, first), ready), r)

    def _reach(self, r: int, first: bool) -> float:
        """When rank `r` gets to its next action: when it is free, or, for an iteration's
        first, its step overhead after its transfers have left ([Note: flush])."""
        free = self.free[r]
        self.reached[r] = (max(free, self.flushed[r]) + self.cluster.step_overhead if first
                           else free)
        return self.reached[r]

    def _execute(self, r: int, k: int, step: int, op: Op, start: float,
                 schedule: bool = True) -> list[int]:
        """Runs one action on a host of its own; schedules the ranks it wakes, or returns
        them."""
        end = (self._lane(r, k, step, op, start) if op.lane_bytes
               else start + self._seconds(r, step, op)[0])
        return self._finish(r, k, step, op, start, end, schedule)

    def _lane(self, r: int, k: int, step: int, op: Op, start: float) -> float:
        """A STASH or FETCH through rank `r`'s copy lane ([Note: copy lane] in
        pipefb.sim.copylane): when it ends on the compute lane (a STASH's consumers on
        other ranks wait for its write through `written` and the fenced sends)."""
        lane, nbytes = self.lanes[r], op.lane_bytes
        combined = self.memory[r].combined
        if op.action.kind is Kind.STASH:
            handed = lane.room(start, nbytes)
            begin, written = lane.write(handed, nbytes)
            self.memory[r].written(written, nbytes)
            self.flushed[r] = max(self.flushed[r], written)
            self._lane_cpu(r, begin, written - begin)
            self.written[step * self.stride + op.key] = written
            return handed + op.seconds
        taken = self.taken.pop((r, self.pos[r]), None)
        if taken is not None:  # issued by the last FETCH (`_try_prefetch`)
            return max(start, taken) + op.seconds
        if self.pending.get(r, (0, -1, 0.0))[1] == self.pos[r]:
            del self.pending[r]
        issue = start
        last = self.fetched.get(r)
        if last is not None and last[0] == k:  # prefetched when the last FETCH ended
            issue = last[1]
            if not combined:  # a backward rank's waits for the receive just before
                before = self.program.ops[r][self.runs[r][self.pos[r] - 1][2]]
                issue = (max(issue, self.arrived.get(r, start))
                         if before.action.kind in _PREFETCH_AFTER else start)
        issue = max(issue, self._missing(step, op)[1])  # every stash handed over
        return max(start, self._take(r, step, op, issue)) + op.seconds

    def _take(self, r: int, step: int, op: Op, issue: float) -> float:
        """When the take of a FETCH issued at `issue` ends on rank `r`'s copy lane."""
        written = max((self.written.pop((step + offset) * self.stride + key, 0.0)
                       for offset, key in op.needs), default=0.0)
        if self.memory[r].combined and written > issue:
            return issue  # its own stash, still being written: taken back from the writer
        begin, taken = self.lanes[r].take(max(issue, written), op.lane_bytes)
        self._lane_cpu(r, begin, taken - begin)
        return taken

    def _prefetch_next(self, r: int, k: int, end: float) -> None:
        """After a FETCH of iteration `k` that ends at `end`, on a loopback host: issues
        the take of the iteration's next FETCH as soon as its inputs are in."""
        run, ops = self.runs[r], self.program.ops[r]
        for q in range(self.pos[r] + 1, len(run)):
            if run[q][0] != k:
                return
            if ops[run[q][2]].action.kind is Kind.FETCH:
                if ops[run[q][2]].lane_bytes:
                    self.pending[r] = (k, q, end)
                    self._try_prefetch(r)
                return

    def _try_prefetch(self, r: int) -> None:
        """Issues rank `r`'s pending prefetch if its stash was handed over (and, on a
        backward rank, the receive before it arrived); else waits for what is missing."""
        if r not in self.pending:
            return
        _, q, issue = self.pending[r]
        run, ops = self.runs[r], self.program.ops[r]
        waits = [(run[q][1], ops[run[q][2]])]
        if not self.memory[r].combined:
            before = ops[run[q - 1][2]]
            if before.action.kind not in _PREFETCH_AFTER:
                del self.pending[r]  # issued when the rank reaches it
                return
            waits.append((run[q - 1][1], before))
        for step, op in waits:
            missing, ready = self._missing(step, op)
            if missing >= 0:
                self.waiting[missing].append(_PREFETCH - r)
                return
            issue = max(issue, ready)
        del self.pending[r]
        self.taken[(r, q)] = self._take(r, run[q][1], waits[0][1], issue)

    def _lane_cpu(self, r: int, begin: float, seconds: float) -> None:
        """On a loopback host, a copy's CPU from `begin`: its copy link's `cpu` times its
        seconds ([Note: copy lane] in pipefb.sim.copylane)."""
        name = self.host[r][0]
        if name not in self.cluster.loopback_hosts or seconds <= 0:
            return
        work = self.lanes[r].link.cpu * seconds

        def start(at: float) -> None:
            self._start_job(name, at, work, _nothing)
        self._after(begin, start)

    def _finish(self, r: int, k: int, step: int, op: Op, start: float, end: float,
                schedule: bool = True, sent: bool = False) -> list[int]:
        """Ends one action: its span (from when the rank reached it: a receive's span holds
        its wait, as the runtime times it), memory, transfers (unless `sent` already) and
        what it makes available."""
        if op.action.kind in _PREFETCH_AFTER:
            self.arrived[r] = self._missing(step, op)[1]
        elif op.action.kind is Kind.FETCH:  # the runtime prefetches the next one now
            self.fetched[r] = (k, end)
            if r in self.eager:
                self._prefetch_next(r, k, end)
        self.free[r] = end
        self.records.append((r, k, step, op.index, min(self.reached[r], start), end))
        in_tier = self.slots.finished(r, step, op)  # [Note: tier cap]
        if in_tier is not None:
            self.memory[r].in_tier(in_tier)
        self.memory[r].apply(step, op, end)
        base = step * self.stride
        woken = self._send(r, step, op, end - op.tail) if op.sends and not sent else []
        if op.key >= 0:
            self.avail[base + op.key] = end
            woken += self.waiting.pop(base + op.key, [])
        self.pos[r] += 1
        if not schedule:
            return woken
        self._schedule(r)
        for waiter in woken:
            self._schedule(waiter)
        return []

    def _send(self, r: int, step: int, op: Op, at: float) -> list[int]:
        """Starts the action's transfers at `at`; returns the ranks their arrival wakes."""
        base = step * self.stride
        woken: list[int] = []
        wait = self._busy_send(r, op) if op.sends else 0.0
        # after the stashes handed over before are written ([Note: copy lane])
        fence = self.lanes[r].out_free if self.fenced[r] else 0.0
        for dst, nbytes, key in op.sends:
            if self.cluster.on_loopback(r, dst):  # a job, so it starts in time order
                self._loopback_transfer(r, dst, nbytes, base + key, at,
                                        max(at + wait, fence) - at)
                continue
            self.avail[base + key] = self._transfer(r, dst, nbytes, max(at, fence))
            self.flushed[r] = max(self.flushed[r], self.links[(r, dst)])  # last byte sent
            woken += self.waiting.pop(base + key, [])
        return woken

    def _transfer(self, src: int, dst: int, nbytes: int, sent: float) -> float:
        """Arrival time of `nbytes` sent at `sent` over the src->dst link (FIFO)."""
        link = self._link(src, dst)
        begin = max(sent, self.links[(src, dst)])
        self.links[(src, dst)] = begin + nbytes / link.bandwidth
        return begin + link.seconds(nbytes)

    def _link(self, src: int, dst: int) -> Link:
        link = self.link_of.get((src, dst))
        if link is None:
            link = self.link_of[(src, dst)] = self.cluster.link(src, dst)
        return link

    def _loopback_transfer(self, src: int, dst: int, nbytes: int, slot: int, sent: float,
                           wait: float = 0.0) -> None:
        """Bytes between ranks of a loopback host: CPU work on the host's cores, the
        link's latency plus the bytes over its bandwidth (see [Note: shared hosts]),
        starting `wait` after `sent` ([Note: busy senders])."""
        def arrived(end: float) -> None:
            self.avail[slot] = end
            self.sending[src] -= 1
            self.flushed[src] = max(self.flushed[src], end)
            for waiter in self.waiting.pop(slot, []):
                self._schedule(waiter)
            if not self.sending[src] and src in self.flushing:
                self.flushing.discard(src)
                self._schedule(src)

        def start(at: float) -> None:
            link, name = self._link(src, dst), self.host[src][0]
            self._start_job(name, at, link.seconds(nbytes), arrived)
            self._other_end(name, at, link, link.seconds(nbytes))

        self.sending[src] += 1
        if wait > 0:
            self._after(sent + wait, start)
        else:
            start(sent)

    def _deadlock(self, stuck: dict[int, tuple[int, int, int]]) -> ScheduleError:
        lines = ["deadlock in simulation: no worker can progress"]
        for r, (_, step, i) in sorted(stuck.items()):
            op = self.program.ops[r][i]
            missing, _ = self._missing(step, op)
            at, key = divmod(missing, self.stride)
            what = self.program.name(key)
            label = (f"PUSH_W of backward stage {what[0]}" if what[1] == "push"
                     else str(Action(what[1], what[0], what[2])))
            lines.append(f"  worker {r}, step {step}: {op.action} waits for {label} of "
                         f"step {at}")
        return ScheduleError("\n".join(lines))


def _nothing(end: float) -> None:
    """The end of a job nothing waits for (the other end's share of a transfer)."""



__all__ = ["Engine"]
