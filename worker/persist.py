"""Trainer callbacks that persist a job's progress: metrics, samples, checkpoints, events, status."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from gspo_core.callbacks import Callbacks, Evaluation
from store import jobs, progress, retention
from store.models import Checkpoint, Job
from store.objects import ARCHIVE_NAME, ObjectStore, put_dir
from store.tenants import StorageQuotaExceeded, stored_bytes
from store.usage import Budget, RunMeter, budget, record_usage

log = logging.getLogger(__name__)


def with_db_retry(fn, *, what: str, deadline_s: float = 600.0):
    """Run ``fn()``; while the database is unreachable retry with backoff (a restart must not
    lose a metric), giving up after ``deadline_s``."""
    t0, delay = time.monotonic(), 0.5
    while True:
        try:
            return fn()
        except OperationalError as exc:
            if time.monotonic() - t0 > deadline_s:
                raise
            log.warning("database unavailable while %s (%s); retrying in %.1fs", what, exc.__class__.__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)


def build_archive(ckpt_dir: Path, root: str) -> Path:
    """``<ckpt>.tar.gz`` of the downloadable parts (model/, adapter/), next to the checkpoint."""
    import tarfile

    out = ckpt_dir.with_name(ckpt_dir.name + ".tar.gz")
    with tarfile.open(out, "w:gz") as tar:
        for part in ("model", "adapter"):
            if (ckpt_dir / part).is_dir():
                tar.add(ckpt_dir / part, arcname=f"{root}/{part}")
    return out


def drop_orphan_uploads(s, objects: ObjectStore, job_id: str) -> list[str]:
    """Delete checkpoint uploads of the job that no checkpoint row references: those of an earlier
    attempt that died (or lost the job) between its upload and its row. Run by the lease holder
    before it trains, so no live attempt of this job is uploading. Returns the prefixes removed."""
    root = f"jobs/{job_id}/checkpoints"
    kept = set(s.scalars(select(Checkpoint.object_prefix).where(Checkpoint.job_id == job_id)))
    found = {f"{root}/{key[len(root) + 1 :].split('/', 1)[0]}" for key, _ in objects.list(root)}
    orphans = sorted(found - kept)
    for prefix in orphans:
        objects.delete_prefix(prefix)
    return orphans


class RunUsage:
    """One run of a job (one claim): its usage meter, where it is written, and the job's wall-clock limit.

    ``limit_s`` counts device time over all the job's attempts (the meter's prior holds the earlier ones).
    """

    def __init__(
        self,
        job_id: str,
        tenant_id: str,
        run_id: str,
        attempt: int,
        meter: RunMeter,
        limit_s: float | None = None,
        limit_source: str = "",
    ) -> None:
        self.job_id, self.tenant_id, self.run_id, self.attempt = job_id, tenant_id, run_id, attempt
        self.meter, self.limit_s, self.limit_source = meter, limit_s, limit_source

    def write(self, s) -> None:
        """Record the run's usage in ``s`` (a transaction that holds the job's lease)."""
        record_usage(s, self.job_id, self.tenant_id, self.run_id, self.attempt, self.meter)

    def add_step(self, metrics: dict) -> None:
        self.meter.add_tokens(metrics.get("tokens/sampled", 0), metrics.get("tokens/trained", 0))

    def over_limit(self) -> bool:
        return self.limit_s is not None and self.meter.device_seconds() >= self.limit_s

    def deadline(self) -> float | None:
        """The `time.monotonic` value at which the job's device time reaches its limit (None: no limit)."""
        if self.limit_s is None:
            return None
        return time.monotonic() + self.limit_s - self.meter.device_seconds()

    def budget_used(self, s) -> Budget | None:
        """The tenant's budget when this period's device time (this run's included) has used it up."""
        b = budget(s, self.meter.policy, self.tenant_id)
        return b if b.exhausted else None

    def limit_error(self, step: int) -> str:
        return (
            f"wall-clock limit reached: the job used {self.meter.device_seconds():.0f} s of device time (all its "
            f"runs together); its limit is {self.limit_s:.0f} s ({self.limit_source}). Stopped after step "
            f"{step}; its checkpoint and metrics are kept"
        )


def evaluation_message(evaluation: Evaluation, recorded: dict | None) -> str:
    """The job log's line for a held-out evaluation; after training, with the one before it: ``before → after``."""
    names = (("greedy_reward", "greedy reward"), ("sampled_reward", "sampled reward"), ("loss", "loss"))
    before = (recorded or {}).get("before") if evaluation.when == "after" else None
    parts = []
    for key, label in names:
        value = getattr(evaluation, key)
        if value is None:
            continue
        was = before.get(key) if before else None
        parts.append(f"{label} {was:.4f} → {value:.4f}" if was is not None else f"{label} {value:.4f}")
    return f"held-out evaluation {evaluation.when} training ({evaluation.prompts} prompts): {', '.join(parts)}"


class PersistCallbacks(Callbacks):
    """Writes through store/ what the trainer reports; stops on cancel, pause, shutdown, lost lease, the
    job's wall-clock limit or its tenant's budget. The trainer asks before each step and, while a step waits on
    tools, agents or graders, about once a second (`gspo_core.stopping`), so none of them waits for a step."""

    def __init__(
        self,
        db,
        objects: ObjectStore,
        job_id: str,
        worker_id: str,
        attempt: int,
        shutdown: threading.Event,
        lease_lost: threading.Event,
        usage: RunUsage | None = None,
        storage_quota: int | None = None,
    ) -> None:
        self.db, self.objects, self.job_id, self.worker_id, self.attempt = db, objects, job_id, worker_id, attempt
        self.shutdown, self.lease_lost, self.usage = shutdown, lease_lost, usage
        self.storage_quota = storage_quota  # bytes of the tenant's files and checkpoints (None: unbounded)
        self.stop_reason: str | None = None
        self.budget: Budget | None = None  # the tenant's spent budget, when that stopped the run
        self.steps_run = 0  # steps this run recorded
        self._deadline: float | None = None  # the wall-clock limit's, as last told to the trainer
        self._first_poll: float | None = None  # when the run's first step began (its first status poll)

    def _tx(self, fn, what: str):
        """``fn(session)`` in one transaction fenced by this worker's lease (`jobs.LeaseLost` if gone)."""

        def run():
            with self.db.session() as s:
                jobs.hold(s, self.job_id, self.worker_id)
                return fn(s)

        try:
            return with_db_retry(run, what=what)
        except jobs.LeaseLost:
            self.lease_lost.set()
            self.stop_reason = "lease_lost"
            raise

    def on_step(self, step, metrics):
        self.steps_run += step > 0  # step 0: the evaluation before the first step, not a step
        if self.usage is not None:
            self.usage.add_step(metrics)  # once per step: the transaction below writes absolute values

        def rec(s):
            progress.record_step(s, self.job_id, step, metrics)
            if self.usage is not None:
                self.usage.write(s)

        self._tx(rec, f"recording step {step}")

    def on_samples(self, step, rows):
        self._tx(lambda s: progress.record_samples(s, self.job_id, step, rows), f"recording samples of step {step}")

    def on_checkpoint(self, step, path, final):
        # The attempt in the prefix keeps a worker that lost the job mid-upload from overwriting the
        # objects of its successor's checkpoint at the same step (its row write is then refused).
        prefix = f"jobs/{self.job_id}/checkpoints/step-{step:06d}-a{self.attempt}"
        self._tx(lambda s: None, f"checking the lease before uploading checkpoint {step}")
        size = put_dir(self.objects, prefix, Path(path))
        if self.objects.presigned_url(f"{prefix}/{ARCHIVE_NAME}") is not None:
            # Object stores that hand out presigned URLs get the download archive ready-made.
            self.objects.put_file(
                f"{prefix}/{ARCHIVE_NAME}", build_archive(Path(path), f"{self.job_id}-step-{step:06d}")
            )

        def rec(s):
            job = s.get(Job, self.job_id)
            progress.record_checkpoint(s, job, step, prefix, size, final)
            dropped = retention.prune(s, job)
            # Counted after retention, under the job's lease: the row goes only with what it keeps.
            if self.storage_quota is not None and (used := stored_bytes(s, job.tenant_id)) > self.storage_quota:
                raise StorageQuotaExceeded(used, self.storage_quota)
            return dropped

        try:
            dropped = self._tx(rec, f"recording checkpoint {step}")
        except StorageQuotaExceeded:  # rolled back: the job fails with the checkpoints it had
            self.objects.delete_prefix(prefix)
            raise
        if dropped:
            try:
                with self.db.session() as s:
                    retention.remove_objects(s, self.objects, dropped)
            except Exception as exc:  # recorded as pending deletions: the API's purge removes them later
                log.warning("checkpoint retention: could not delete %s yet (%s)", dropped, exc)
            self.db.checkpoint_wal()  # the deleted rows leave SQLite's WAL file

    def on_log(self, message):
        self._tx(lambda s: jobs.add_event(s, self.job_id, "log", message), "logging")

    def on_evaluation(self, evaluation: Evaluation) -> None:
        def rec(s):
            progress.record_evaluation(s, self.job_id, evaluation.as_dict())
            jobs.add_event(s, self.job_id, "log", evaluation_message(evaluation, s.get(Job, self.job_id).evaluation))

        self._tx(rec, f"recording the evaluation {evaluation.when} training")

    def deadline(self) -> float | None:
        self._deadline = self.usage.deadline() if self.usage is not None else None
        return self._deadline

    def _past_limit(self) -> bool:
        """The wall-clock limit is reached (by the meter, or by the deadline the trainer was given)."""
        if self.usage is None:
            return False
        return self.usage.over_limit() or (self._deadline is not None and time.monotonic() >= self._deadline)

    def _budget_applies(self) -> bool:
        """Whether the tenant's budget may stop the run now: from its second step on; in its first step (the
        first poll starts it) only once that step has lasted a whole period's budget, so a run whose start-up
        outlasts the budget still progresses, and a step that waits on a slow agent or tool is still bounded."""
        if self.usage is None or self.usage.meter.policy.budget_s <= 0:
            return False
        now = time.monotonic()
        self._first_poll = self._first_poll or now
        return bool(self.steps_run) or now - self._first_poll >= self.usage.meter.policy.budget_s

    def should_stop(self) -> bool:
        if self.lease_lost.is_set():
            self.stop_reason = "lease_lost"
        elif self.shutdown.is_set():
            self.stop_reason = "shutdown"
        else:
            status = self._tx(lambda s: s.get(Job, self.job_id, populate_existing=True).status, "polling status")
            if status == "cancelling":
                self.stop_reason = "cancel"
            elif status == "pausing":  # asked to pause: the trainer checkpoints this step boundary and stops
                self.stop_reason = "pause"
            elif self._past_limit():
                self.stop_reason = "wall_limit"
            elif self.usage is not None and self._budget_applies():
                # A running job stops too when its tenant spends the period's budget: it is requeued from
                # its checkpoint and waits, like the tenant's queued jobs, for the next period.
                self.budget = self._tx(self.usage.budget_used, "checking the tenant's budget")
                if self.budget is not None:
                    self.stop_reason = "budget"
        return self.stop_reason is not None


class Heartbeat:
    """Renews the job's lease in a thread (and writes the run's usage); sets ``lost`` if another worker
    took it over."""

    def __init__(
        self, db, job_id: str, worker_id: str, lease_s: float, every_s: float, usage: RunUsage | None = None
    ) -> None:
        self.db, self.job_id, self.worker_id, self.lease_s, self.every_s = db, job_id, worker_id, lease_s, every_s
        self.usage = usage
        self.lost, self._stop = threading.Event(), threading.Event()
        self._th = threading.Thread(target=self._loop, name=f"heartbeat-{job_id}", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                with self.db.session() as s:
                    ok = jobs.heartbeat(s, self.job_id, self.worker_id, self.lease_s)
                    if ok and self.usage is not None:  # a crash loses at most one beat of device time
                        self.usage.write(s)
            except OperationalError as exc:  # database down: keep training, try again
                log.warning("heartbeat failed: %s", exc.__class__.__name__)
                continue
            if not ok:
                self.lost.set()
                return

    def __enter__(self) -> Heartbeat:
        self._th.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._th.join(timeout=5)
