"""The replica's side of the Coordinator protocol, in one object (torchft's ``Manager``).

It registers the replica, copies state from a donor (or the initial checkpoint) until the
Coordinator marks it ready, reports progress without the training loop waiting for the
reply, takes the plans the Coordinator pushes, runs the step strategy's global step,
commits it (epoch, lineage, digest), rejoins a restarted Coordinator and resyncs when told.

Its phase is an explicit state machine (``protocol.py``: joining, syncing, training,
stepping, overlapping, resyncing, stopping, closed; illegal edges raise, a timestamped
history is kept in ``protocol``), and whether a plan is taken is decided in one place,
``protocol.accept_plan``.

It lives on the replica actor's event loop; the training loop's thread calls
``after_micro_batch`` once per micro-batch (through the ``Session``) and waits for it.
Failures of other peers never raise here (the averager's deadlines bound every round);
a step whose averaging errored (``AveragingError``: the weighted mean was not finite) is
committed with nothing applied, counted in ``errored_steps``, and training goes on (a
replica whose parameters then differ from the swarm's is resynced by the Coordinator's
checksum vote); a Coordinator that is briefly away is retried by Ray (its calls have task
retries) and reports that fail are dropped (the next one carries the same progress).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import ray

from moshray.cluster import metrics
from moshray.cluster.collective.averager import Averager, AveragingError
from moshray.cluster.collective.deadline import DeadlinePolicy
from moshray.cluster.messages import CheckpointRef, PeerPlan, RejectReason
from moshray.cluster.coordinator.progress import ProgressReport
from moshray.cluster.coordinator.step_profile import PhaseClock

from moshray.actors.replica.metrics_outbox import MetricsOutbox
from moshray.actors.replica.protocol import (
    COPYING,
    LOOP_RUNS,
    TABLE,
    Phase,
    PlanAction,
    PlanDecision,
    ReplicaView,
    accept_plan,
)
from moshray.actors.replica.state import TrainState
from moshray.actors.replica.strategies import Strategy
from moshray.cluster.state_machine import StateMachine

log = logging.getLogger(__name__)

MAX_OWN_REJECTIONS = 3  # consecutive steps with our contribution rejected -> resync
SYNC_ATTEMPTS = 600
SNAPSHOT_WAIT_S = 5.0  # a donor's state waits at most this long for the loop's sync point
HISTORY = 256  # protocol transitions kept (two per step)


@dataclass
class Tally:
    """The micro-batches since the last step (or state copy): what a contribution weighs,
    and the losses the loop gave (``add``'s, or reported as ``"loss"``: ``note_loss``)."""

    samples: int = 0
    micro: int = 0
    loss_sum: float = 0.0
    loss_weight: float = 0.0

    def add(self, samples: int, loss: float | None = None) -> None:
        self.samples += samples
        self.micro += 1
        if loss is not None:
            self.loss_sum += loss * samples
            self.loss_weight += samples

    def note_loss(self, loss: float) -> None:
        """A loss the loop reported (``session.report({"loss": ...})``): one vote."""
        self.loss_sum += loss
        self.loss_weight += 1

    @property
    def mean_loss(self) -> float | None:
        return self.loss_sum / self.loss_weight if self.loss_weight else None


@dataclass(frozen=True)
class Overlapped:
    """The payload of the ``overlapping`` phase: the plan, its averaging task and the
    micro-batches the step's contribution was taken after."""

    plan: PeerPlan
    task: asyncio.Task
    tally: Tally


class StepManager:
    """See module docstring. ``handle`` is the replica actor's own handle (peers and the
    Coordinator call it); ``resume`` the checkpoint the job starts from (a ``CheckpointRef``,
    read from the store by this replica when it has no donor; ``config``, the job's config
    dict, checks its shapes);
    ``clock`` times the protocol's transitions and the join (monotonic seconds)."""

    def __init__(self, peer_id: str, coordinator, handle, node_id: str, round_timeout_s: float,
                 resume: CheckpointRef | None = None, clock=time.monotonic,
                 config: dict | None = None,
                 job_key: bytes | None = None, deadline: DeadlinePolicy | None = DeadlinePolicy()):
        self.peer_id, self.coordinator, self.handle = peer_id, coordinator, handle
        self.node_id, self.round_timeout_s = node_id, round_timeout_s
        self._clock = clock
        self.protocol = StateMachine(TABLE, peer_id, Phase.JOINING, clock, keep=HISTORY)
        # signs and checks contributions with the job's key (collective/auth.py)
        # ``deadline``: adaptive round deadlines (None: every round waits round_timeout_s)
        self.averager = Averager(peer_id, job_key=job_key, deadline=deadline)
        self.state: TrainState | None = None
        self.strategy: Strategy | None = None
        self.tally = Tally()
        self.own_rejections = 0  # steps with this replica's contribution rejected
        self.errored_steps = 0  # steps committed with nothing applied (AveragingError)
        # what the loop reported since the last flush: name -> (global step, value)
        self._reported: dict[str, tuple[int, float]] = {}
        self.consecutive_bad = 0
        self.lock = asyncio.Lock()  # held while the state changes (steps, loads)
        self.started_at = clock()  # join time is measured from here
        self.joined = False  # contributed to an averaged step yet?
        self._resume, self._config = resume, config or {}
        self._plan: PeerPlan | None = None  # pushed by the Coordinator, not yet taken
        self._overlapped: Overlapped | None = None  # the payload of ``overlapping``
        # (epoch sent at, rejoin generation sent in, reply)
        self._inflight: list[tuple[int, int, asyncio.Future]] = []
        # others' rejected contributions, for the Coordinator: (sender, reason, epoch, numel)
        self._saw_rejections: list[tuple[str, str, int, int]] = []
        self._contributed: tuple[int, int] | None = None  # (epoch, samples) to report once
        self._heartbeat: asyncio.Future | None = None
        self._snapshot_requests: list[asyncio.Future] = []
        self._generation = 0  # rejoins done: an "unknown" from before one is answered
        self._rejoin_lock = asyncio.Lock()
        self.phases = PhaseClock(clock)  # where the time goes (coordinator/step_profile.py)
        self._profiled = None  # the last step's StepPhases, sent with its metrics events
        self.outbox = MetricsOutbox(peer_id, coordinator)  # metrics events, in batches

    # -- the protocol's phase --------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self.protocol.state

    @property
    def stopping(self) -> bool:
        """The Coordinator said stop (or the loop ended): ``batches()`` ends."""
        return self.phase in (Phase.STOPPING, Phase.CLOSED)

    @property
    def syncing(self) -> bool:
        """Copying a donor's state (not ready)."""
        return self.phase in COPYING

    @property
    def loop_running(self) -> bool:
        """Between the loop's ``prepare()`` and its end."""
        return self.phase in LOOP_RUNS

    def _view(self) -> ReplicaView:
        epoch = self.state.epoch if self.state is not None else 0
        return ReplicaView(self.phase, epoch, bool(getattr(self.strategy, "overlap", False)))

    def _decide(self, plan: PeerPlan | None) -> PlanDecision | None:
        """``accept_plan`` for ``plan`` in the current view (None for no plan)."""
        return None if plan is None else accept_plan(self._view(), plan)

    # -- joining ---------------------------------------------------------------------------

    async def start(self, state: TrainState, strategy) -> None:
        """Register, take the state of the swarm (donor or checkpoint), start heartbeats."""
        self.state, self.strategy = state, strategy
        await self.coordinator.register.remote(self.peer_id, self.handle, self.node_id)
        # Heartbeats first: a Coordinator restarted during the copy learns of this replica
        # from them (``rejoin``), else it would refuse its ``mark_ready``.
        self.protocol.to(Phase.SYNCING)
        self._heartbeat = asyncio.ensure_future(self._beat())
        await self._sync()
        self.protocol.to(Phase.TRAINING)
        self.send_report(force=True)

    async def resync(self, reason: str) -> None:
        """Copy a donor's state again while the loop waits (``training -> resyncing ->
        training``). A ``UserError`` in the loaded state propagates."""
        self.protocol.to(Phase.RESYNCING, reason)
        await self._sync()
        self.protocol.to(Phase.TRAINING)

    async def _sync(self) -> None:
        """Copy state from a donor until the Coordinator marks this replica ready. With no
        donor (no replica holds the swarm's state: a new swarm, or every holder died) the
        state comes from the run's newest checkpoint the Coordinator knows of
        (``latest_checkpoint``, read once per call), if it is newer than the checkpoint the
        job started from (``resume``), else from that one, read from the store here (never
        through the driver); falling back below a committed step is the Coordinator's
        counted rollback. ``RuntimeError`` after ``SYNC_ATTEMPTS`` tries; a checkpoint that
        cannot be read is logged and the next source used; a ``UserError`` (the resumed
        checkpoint's shapes differ) propagates."""
        newest: dict | None = None  # the newest checkpoint's state (read on first need)
        resumed: dict | None = None  # the state the job resumes from (read on first need)
        read = read_resumed = False
        held = None  # the donorless state loaded last ("checkpoint", "initial"): loaded once
        for attempt in range(SYNC_ATTEMPTS):
            donor = await self.coordinator.donor.remote(self.peer_id)
            if donor is not None:
                try:
                    _, [ref] = await donor[1].get_state.remote()
                    loaded = await ref
                except ray.exceptions.RayError as exc:
                    log.warning("%s: donor %s failed (%s); retrying", self.peer_id, donor[0],
                                type(exc).__name__)
                    await asyncio.sleep(0.2)
                    continue
                await self._load(loaded, from_donor=True)
                held = None
            else:
                if not read:
                    newest, read = await self._newest_checkpoint(), True
                if newest is None and not read_resumed:
                    resumed, read_resumed = await self._resumed_state(), True
                source = ("checkpoint" if newest is not None else
                          "initial" if resumed is not None else None)
                if source is not None and held != source:
                    await self._load(newest if newest is not None else resumed,
                                     from_donor=False)
                    held = source
                if source is not None:
                    await self.coordinator.resume_from.remote(self.state.epoch)
            if await self.coordinator.mark_ready.remote(self.peer_id, self.state.epoch):
                log.info("%s ready at epoch %d (attempt %d)", self.peer_id, self.state.epoch,
                         attempt)
                return
            if attempt % 50 == 49:
                log.warning("%s: still syncing after %d attempts (donor %s, state epoch %d)",
                            self.peer_id, attempt + 1, donor and donor[0], self.state.epoch)
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.peer_id}: could not sync state after {SYNC_ATTEMPTS} attempts")

    async def _newest_checkpoint(self) -> dict | None:
        """The state of the run's newest checkpoint if it is newer than the initial state
        (and this replica's own), else None (also when it cannot be read: logged)."""
        from moshray.actors.replica.checkpoint import CheckpointStore

        ref = await self.coordinator.latest_checkpoint.remote()
        floor = self.state.epoch if self.state is not None else 0
        if self._resume is not None:
            floor = max(floor, self._resume.step)
        if ref is None or ref.step <= floor:
            return None
        try:
            found = await asyncio.to_thread(
                CheckpointStore(ref.uri, run_id=ref.run_id).load_latest)
        except OSError as exc:
            log.warning("%s: checkpoint of step %d in %s/%s not read (%s): no donor, so the "
                        "initial state", self.peer_id, ref.step, ref.uri, ref.run_id, exc)
            return None
        if found is None or found[0] <= floor:
            return None
        log.warning("%s: no replica holds the swarm's state: resuming from the checkpoint "
                    "of step %d (%s/%s)", self.peer_id, found[0], ref.uri, ref.run_id)
        return found[1]

    async def _resumed_state(self) -> dict | None:
        """The state of the checkpoint the job resumes from (``checkpoint.load_resumed``,
        read from the store in a thread), or None: no ``resume``, or no valid checkpoint is
        left there (every one failed its checksums: logged, the initial model is used, as a
        driver that found none would). A store that cannot be read raises ``RuntimeError``
        (the replica fails and is counted; a new one tries again)."""
        from moshray.actors.replica.checkpoint import load_resumed

        if self._resume is None:
            return None
        ref = self._resume
        try:
            found = await asyncio.to_thread(load_resumed, ref, self._config)
        except OSError as exc:
            raise RuntimeError(f"{self.peer_id}: the checkpoint to resume from ({ref.uri}/"
                               f"{ref.run_id}, step {ref.step}) not read: {exc}") from exc
        if found is None:
            log.warning("%s: no valid checkpoint left in %s/%s to resume from; starting from "
                        "the initial model", self.peer_id, ref.uri, ref.run_id)
            return None
        return found[1]

    async def _load(self, loaded: dict, from_donor: bool) -> None:
        async with self.lock:
            self.state.load(loaded, from_donor)
            self.strategy.discard_pending()
            self.tally = Tally()

    async def snapshot(self) -> dict:
        """The state at the training loop's next sync point (inside ``opt.step``, after the
        user's code has updated its extra state for the last global step), or at once
        under the lock when the loop is not running or does not come by within
        ``SNAPSHOT_WAIT_S``. Never mid-step."""
        if self.loop_running:
            future = asyncio.get_running_loop().create_future()
            self._snapshot_requests.append(future)
            try:
                return await asyncio.wait_for(asyncio.shield(future), SNAPSHOT_WAIT_S)
            except asyncio.TimeoutError:
                log.info("%s: state taken outside the loop's sync point", self.peer_id)
        async with self.lock:
            return self.state.snapshot()

    async def _serve_snapshots(self) -> None:
        if not self._snapshot_requests or self.phase is Phase.OVERLAPPING:
            return  # (not while an overlapped step is half done: at the next sync point)
        async with self.lock:
            snap = self.state.snapshot()
        requests, self._snapshot_requests = self._snapshot_requests, []
        for future in requests:
            if not future.done():
                future.set_result(snap)

    async def loop_ended(self) -> None:
        """The training loop returned (or raised): apply an overlapped step still in
        flight, put back the buffers as of the last step (``TrainState.step_buffers``) and
        what the strategy holds as of it (``Strategy.settle``), serve what waits for a
        snapshot, and close the protocol."""
        if self.state is not None:
            await self._finish_overlapped(wait=True)
            async with self.lock:
                self.state.restore_step_buffers()
                self.strategy.settle(self.state.model)
        if self.phase is not Phase.CLOSED:
            self.protocol.to(Phase.CLOSED)
        if self.state is not None:
            await self._serve_snapshots()
        self.flush_reported()
        self.record((), flush=True)

    # -- progress --------------------------------------------------------------------------

    def receive_plan(self, plan: PeerPlan) -> None:
        """A plan from the Coordinator (pushed, or in a report's reply): held for the next
        micro-batch if ``accept_plan`` takes it, else ignored."""
        if self._decide(plan).take:
            self._plan = plan
            self.phases.plan_arrived()

    def send_report(self, force: bool = False) -> None:
        """Progress to the Coordinator without waiting for the reply; at most one routine
        report in flight, ``force`` sends anyway (right after a step or a sync)."""
        if self._inflight and not force:
            return
        s = self.state
        report = ProgressReport(self.peer_id, s.epoch, self.tally.samples,
                                self.tally.mean_loss, s.step_checksum, self.own_rejections,
                                tuple(self._saw_rejections), self._numel(), self._contributed,
                                self.tally.micro, s.branch)
        self._saw_rejections.clear()
        self._contributed = None
        ref = self.coordinator.report.remote(report)
        self._inflight.append((s.epoch, self._generation, asyncio.ensure_future(_awaited(ref))))

    def _numel(self) -> int:
        """The length of the tensor this replica averages (``Strategy.numel``)."""
        return self.strategy.numel(self.state.model)

    def _replies(self) -> str | None:
        """Handle the replies that arrived: ``"stop"``, ``"resync"`` (if still meant for this
        replica's epoch) or ``"rejoin"``; a plan to take is kept. None if nothing to do."""
        verdict = None
        while self._inflight and self._inflight[0][2].done():
            sent_at, generation, future = self._inflight.pop(0)
            try:
                reply = future.result()
            except ray.exceptions.RayError as exc:
                log.info("%s: report failed (%s)", self.peer_id, type(exc).__name__)
                continue
            if reply.unknown:
                if generation == self._generation:  # else a rejoin since answered it
                    verdict = verdict or "rejoin"
            elif reply.stop:
                verdict = "stop"
            elif reply.resync and sent_at == self.state.epoch and verdict is None:
                verdict = "resync"
            elif reply.plan is not None:
                self.receive_plan(reply.plan)
        return verdict

    async def after_micro_batch(self, samples: int, loss: float | None = None) -> bool:
        """Count one micro-batch and act on what the Coordinator said; True if a global step
        was applied. Enters ``stopping`` when the Coordinator says stop. An overlapped step
        (``strategy.overlap``) is started here and applied at the first sync point after
        its averaging is done, or before anything else changes the state."""
        self.phases.enter()
        try:
            return await self._after_micro_batch(samples, loss)
        finally:
            self.phases.leave()

    async def _after_micro_batch(self, samples: int, loss: float | None) -> bool:
        self.tally.add(samples, loss)
        applied = await self._finish_overlapped(wait=False)
        await self._serve_snapshots()
        # A synchronous step reports right after: a routine report now is not needed
        # (what it carries stays queued).
        due = self._decide(self._plan)
        if applied or due is None or due.action is not PlanAction.STEP:
            self.send_report(force=applied)
        verdict = self._replies()
        if verdict is not None:
            applied = await self._finish_overlapped(wait=True) or applied
        if self.phase is Phase.STOPPING:
            return applied  # (a loop that goes on after the stop: nothing more to do)
        if verdict == "stop":
            self.protocol.to(Phase.STOPPING)
            return False
        if verdict in ("resync", "rejoin"):
            await (self.resync("told to resync") if verdict == "resync"
                   else self.rejoin(self._generation))
            self.send_report(force=True)
            return False
        plan, self._plan = self._plan, None
        decision = self._decide(plan)
        if decision is None or not decision.take:
            return applied
        if decision.action is PlanAction.OVERLAP:
            self._begin_overlapped(plan)
            return applied
        await self.global_step(plan)
        self.send_report(force=True)
        return True

    def _begin_overlapped(self, plan: PeerPlan) -> None:
        """Start ``plan``'s averaging on what was accumulated so far and let the loop go on
        (its next micro-batches count toward the step after)."""
        s = self.state
        tensors = self.strategy.contribution(s.model, self.tally.micro)
        task = asyncio.ensure_future(self.strategy.average(
            self.averager, tensors, plan, self.tally.samples, self.round_timeout_s))
        self.protocol.to(Phase.OVERLAPPING, f"step {plan.epoch}")
        self._overlapped = Overlapped(plan, task, self.tally)
        self.tally = Tally()

    async def _finish_overlapped(self, wait: bool) -> bool:
        """Apply the overlapped step if its averaging is done (``wait``: wait for it; the
        round's deadlines bound that). True if a step was applied."""
        pending = self._overlapped
        if pending is None or not (wait or pending.task.done()):
            return False
        try:
            averaged, report = await pending.task
        except AveragingError as exc:
            self._overlapped = None
            async with self.lock:
                self._errored(pending.plan, exc)
            self.protocol.to(Phase.TRAINING, f"step {pending.plan.epoch} errored")
            return True
        finally:
            self._overlapped = None
        s = self.state
        self.phases.step_begins()
        async with self.lock:
            self.strategy.apply(s.model, s.optimizer, averaged, report.total_weight)
            self._commit(pending.plan)  # (the digest: the step's state, the same everywhere)
            self.strategy.resume(s.model)  # the loop's own progress since, back in
        self.protocol.to(Phase.TRAINING, f"step {pending.plan.epoch} applied")
        self._profiled = self.phases.step_ends(
            pending.plan.epoch, report.seconds, pending.tally.samples, pending.tally.micro,
            overlapped=True, round_phases=report.phases, rounds=report.rounds)
        await self._after_round(pending.plan, report)
        return True

    # -- the global step ---------------------------------------------------------------------

    async def global_step(self, plan: PeerPlan) -> None:
        """One synchronous step (``training -> stepping -> training``): average, apply,
        commit (an errored averaging: commit, nothing applied)."""
        s = self.state
        self.phases.step_begins()
        self.protocol.to(Phase.STEPPING, f"step {plan.epoch}")
        async with self.lock:
            try:
                report = await self.strategy.global_step(
                    s.model, s.optimizer, self.averager, plan, self.tally.samples,
                    self.tally.micro, self.round_timeout_s)
            except AveragingError as exc:
                report = None
                self._errored(plan, exc)
            else:
                self._commit(plan)
                self._profiled = self.phases.step_ends(plan.epoch, report.seconds,
                                                       self.tally.samples, self.tally.micro,
                                                       round_phases=report.phases,
                                                       rounds=report.rounds)
            self.tally = Tally()
        if report is None:
            self.protocol.to(Phase.TRAINING, f"step {plan.epoch} errored")
            return
        self.protocol.to(Phase.TRAINING, f"step {plan.epoch} committed")
        await self._after_round(plan, report)

    def _commit(self, plan: PeerPlan) -> None:
        self.state.commit(plan.epoch, plan.branch)

    def _errored(self, plan: PeerPlan, exc: AveragingError) -> None:
        """The step's averaging errored: commit it with nothing applied (every member of
        the errored group does the same; see module docstring) and count it."""
        self.errored_steps += 1
        log.warning("%s: step %d errored, nothing applied (%s; %d errored so far)",
                    self.peer_id, plan.epoch, exc.detail, self.errored_steps)
        self._commit(plan)
        self.flush_reported()

    # -- what the loop reports (session.report) ------------------------------------------------

    def note_reported(self, values: tuple, step: int) -> None:
        """The loop reported ``values`` (``(name, float)`` pairs) at global ``step``; kept
        until the next flush (the last value per name). ``"loss"`` also goes into the
        progress tally (the loss the console and the summary show). Event loop only."""
        for name, value in values:
            self._reported[name] = (step, value)
            if name == "loss":
                self.tally.note_loss(value)

    def flush_reported(self) -> None:
        """Send what was reported since the last flush (``metrics.ReportedEvent``)."""
        if not self._reported:
            return
        rows = tuple((name, step, value) for name, (step, value) in self._reported.items())
        self._reported.clear()
        self.record((metrics.ReportedEvent(self.peer_id, rows),))

    async def _after_round(self, plan: PeerPlan, report) -> None:
        """Metrics (what the loop reported during the step too), rejections for the
        Coordinator, and a resync after too many of our own contributions were rejected in
        a row."""
        self.flush_reported()
        self._record(report)
        self._saw_rejections.extend((r.sender, r.reason.value, plan.epoch, r.numel)
                                    for r in report.rejections if r.sender != self.peer_id)
        # a forger can name us (``UNAUTHENTICATED``): that says nothing about our values
        mine = [r for r in report.rejections if r.sender == self.peer_id
                and r.reason is not RejectReason.UNAUTHENTICATED]
        if not mine:
            self.consecutive_bad = 0
            return
        self.own_rejections += 1
        self.consecutive_bad += 1
        log.warning("%s: own contribution rejected at epoch %d (%s)", self.peer_id, plan.epoch,
                    mine[0].reason.value)
        if self.consecutive_bad >= MAX_OWN_REJECTIONS:
            log.warning("%s: %d bad steps in a row; restarting from a donor", self.peer_id,
                        self.consecutive_bad)
            self.consecutive_bad = 0
            await self.coordinator.leave.remote(self.peer_id)
            await self.coordinator.register.remote(self.peer_id, self.handle, self.node_id)
            await self.resync(f"{MAX_OWN_REJECTIONS} own contributions rejected in a row")

    def _record(self, report) -> None:
        """Metrics events for one averaging round (fire-and-forget; ``cluster/metrics``): the
        round itself and, after this replica's first averaged step, its join time. Also
        what this replica put into the step, for its next report (``contributed``)."""
        events: list = [metrics.RoundEvent.from_report(report)]
        if self._profiled is not None and self.peer_id in report.contributors:
            self._contributed = (report.epoch, self._profiled.samples)
        if self._profiled is not None:
            events.append(self._profiled)
            self._profiled = None
        if not self.joined and self.peer_id in report.contributors:
            self.joined = True
            events.append(metrics.JoinEvent(max(0.0, self._clock() - self.started_at)))
        self.record(tuple(events))

    def record(self, events: tuple, flush: bool = False) -> None:
        """Metrics events to the Coordinator, fire-and-forget, in batches (``MetricsOutbox``:
        at once with ``flush``: heartbeat, loop end, ``close``)."""
        self.outbox.add(events, flush)

    # -- a Coordinator that restarted -----------------------------------------------------------

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.flush_reported()  # (a loop whose steps are rare shows its reports anyway)
            self.record((), flush=True)
            try:
                generation = self._generation
                if not await self.coordinator.heartbeat.remote(
                        self.peer_id, self.averager.meter.value):
                    await self.rejoin(generation)
            except ray.exceptions.RayError:
                pass

    async def rejoin(self, generation: int) -> None:
        """The Coordinator restarted and forgot this replica: re-register with the epoch
        and branch of the state held (it is ready at once if that is the newest; not while
        it copies a donor's state, nor if the swarm fell back from that branch meanwhile)
        and the data position this replica knows. ``generation``: the rejoin
        count when the "unknown" answer was asked for; if another rejoin happened since
        (the heartbeat and a report both heard it), nothing is done."""
        async with self._rejoin_lock:
            if generation != self._generation:
                return
            syncing = self.syncing
            async with self.lock:
                epoch, branch = self.state.epoch, self.state.branch
                position = self.state.feed.position if self.state.feed is not None else 0
            ready = await self.coordinator.rejoin.remote(
                self.peer_id, self.handle, self.node_id, epoch, position, syncing, branch)
            self._generation += 1
        log.warning("%s: rejoined a restarted Coordinator at epoch %d (%s)", self.peer_id,
                    epoch, "ready" if ready else "syncing" if syncing else "to resync")

    def close(self) -> None:
        self.record((), flush=True)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for _, _, future in self._inflight:
            future.cancel()


async def _awaited(ref):
    return await ref
