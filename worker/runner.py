"""Runs one job: claim its lease, fetch inputs, train with persisting callbacks, settle its status."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import uuid
from pathlib import Path

from pydantic import ValidationError

from gspo_core.agents.tools import ToolSpecError
from gspo_core.config import GSPOConfig, JobSpec, Resources
from gspo_core.data import DataError
from gspo_core.environments import (
    EnvironmentSpecError,
    ReasoningGymEnvironment,
    parse_environment,
    write_environment_rows,
)
from gspo_core.environments.isolated import Isolation
from gspo_core.launch import RankLost, other_ranks
from gspo_core.platform import RuntimeOptions, prepare_process
from gspo_core.rewards import GraderPolicy, map_reward_models
from gspo_core.urls import redact_userinfo
from store import jobs, progress, results
from store.model_refs import resolve_model
from store.models import Checkpoint, File, Job
from store.objects import ObjectStore, get_dir
from store.private import private_dir
from store.queue import enqueue_run_job
from store.scheduling import claim_next, fits
from store.settings import Settings, get_settings
from store.tenants import StorageQuotaExceeded
from store.usage import QueuePolicy, RunMeter
from worker.context import SHUTDOWN, get_db, get_store
from worker.persist import Heartbeat, PersistCallbacks, RunUsage, drop_orphan_uploads, with_db_retry
from worker.ranks import allow_children
from worker.reaper import reap_once

log = logging.getLogger(__name__)


class JobInputError(Exception):
    """The job's model or data cannot be used; the message tells the user what to fix."""


def _fetch_inputs(
    s, objects: ObjectStore, job: Job, work: Path, settings_models_dir: Path
) -> tuple[str, str | None, str | None]:
    """Local paths of the model, training file and validation file of ``job`` (no files: an environment's job)."""

    def fetch_file(file_id: str | None, name: str) -> str:
        # None: the file was deleted (the job's reference is SET NULL); reported like a missing row.
        f = s.get(File, file_id) if file_id is not None else None
        if f is None:
            raise JobInputError(f"dataset {file_id} no longer exists (was it deleted?)")
        dest = work / name
        dest.write_bytes(objects.get_bytes(f.object_key))
        return str(dest)

    train_path = fetch_file(job.training_file_id, "train.jsonl") if job.environment is None else None
    val_path = fetch_file(job.validation_file_id, "val.jsonl") if job.validation_file_id else None
    model = resolve_model(settings_models_dir, job.model)
    if model.startswith("ckpt:"):
        ckpt = s.get(Checkpoint, model[5:])
        if ckpt is None or ckpt.tenant_id != job.tenant_id:
            raise JobInputError(f"checkpoint {model[5:]} not found")
        model = str(get_dir(objects, f"{ckpt.object_prefix}/model", work / "base_model"))
    return model, train_path, val_path


def _resume_dir(s, objects: ObjectStore, job_id: str, out_dir: Path) -> str | None:
    """Download the job's latest checkpoint (model + trainer state) for an exact resume."""
    ckpt = progress.latest_checkpoint(s, job_id)
    if ckpt is None:
        return None
    return str(get_dir(objects, ckpt.object_prefix, out_dir / "checkpoints" / f"step-{ckpt.step:06d}"))


def wall_limit(job_limit: int | None, settings: Settings) -> tuple[float | None, str]:
    """The job's device-time limit (the smaller of its own ask and the operator's; 0/None: none) and
    where it comes from."""
    operator = settings.max_job_wall_seconds or None
    if job_limit and (operator is None or job_limit <= operator):
        return float(job_limit), "the job's max_wall_seconds"
    return operator, "the operator's GSPO_MAX_JOB_WALL_SECONDS"


def _claim(s, job_id: str, worker_id: str, settings: Settings) -> Job | None:
    """The job this message runs: its own job when that job's worker died (takeover of the stale lease),
    else the fairest queued job (`store.scheduling`): a message is a token for one job slot. Either must
    fit this worker's devices."""
    fit = fits(settings.worker_devices)
    return jobs.claim_stale(s, job_id, worker_id, settings.lease_seconds, fit) or claim_next(
        s, worker_id, settings.lease_seconds, QueuePolicy.of(settings), fit
    )


def _stopped_why(reason: str | None, cb: PersistCallbacks) -> str:
    """Why a graceful stop requeues the job, for its log."""
    if reason == "shutdown":
        return "worker shutting down"
    if reason == "pause":
        return "resumed while pausing"
    assert cb.budget is not None, "a budget stop records the spent budget"
    return f"the tenant's device-hour budget of this period is used (until {cb.budget.period_end.isoformat()})"


def _settle(db, objects: ObjectStore, job_id: str, worker_id: str, cb: PersistCallbacks, settings) -> str:
    """Write the outcome of a finished or stopped run (its holder only; retried while the database is
    down, so a restart at the end of a run does not turn a finished job into a failed one). A job that
    ended gets its results file in the same transaction."""
    reason = cb.stop_reason
    if reason == "lease_lost":
        return "lease_lost"

    def run() -> str:
        with db.session() as s:
            jobs.hold(s, job_id, worker_id)
            if cb.usage is not None:
                cb.usage.write(s)
            job = s.get(Job, job_id, populate_existing=True)
            outcome = _outcome(s, job, reason, cb)
            results.attach(s, objects, job, settling=True)  # None for a paused or requeued job: not ended
            return outcome

    outcome = with_db_retry(run, what="settling the job")
    if outcome == "requeued":
        try:
            enqueue_run_job(settings, job_id)
        except Exception as exc:  # the job is safely queued in the database; the reaper re-sends it
            log.warning("could not publish the requeued job %s (%s); the reaper will send it again", job_id, exc)
    return outcome


def _outcome(s, job: Job, reason: str | None, cb: PersistCallbacks) -> str:
    """The status change that settles a run stopped for ``reason`` (None: it ran to its last step)."""
    if reason == "cancel" or job.status == "cancelling":
        jobs.transition(s, job, "cancelled")
        return "cancelled"
    if reason == "wall_limit":
        assert cb.usage is not None, "only a run with a usage meter stops at its wall limit"
        jobs.transition(s, job, "failed", error=cb.usage.limit_error(job.step))
        return "wall_limit"
    if reason is None:
        jobs.transition(s, job, "succeeded")
        return "succeeded"
    if job.status == "pausing":  # asked to pause (or stopped otherwise while pausing): checkpointed, paused
        jobs.add_event(s, job.id, "log", f"paused at step {job.step}: checkpointed; resume to continue")
        jobs.transition(s, job, "paused")
    else:
        jobs.add_event(s, job.id, "log", f"{_stopped_why(reason, cb)}: checkpointed and requeued")
        jobs.transition(s, job, "queued")
    job.attempts = max(0, job.attempts - 1)  # a graceful stop is not a failed attempt
    return "paused" if job.status == "paused" else "requeued"


def _fail(db, objects: ObjectStore, job_id: str, worker_id: str, message: str, usage: RunUsage | None = None) -> str:
    message = redact_userinfo(message)  # an exception's text may quote a tenant's URL with its credentials

    def run():
        with db.session() as s:
            jobs.hold(s, job_id, worker_id)
            if usage is not None:
                usage.write(s)
            job = s.get(Job, job_id, populate_existing=True)
            jobs.transition(s, job, "failed", error=message)
            results.attach(s, objects, job, settling=True)

    try:
        with_db_retry(run, what="marking the job failed")
    except jobs.LeaseLost:  # another worker runs it now: its outcome is not ours to write
        log.warning("job %s failed here (%s), but this worker no longer holds it", job_id, message)
        return "lease_lost"
    return "failed"


def _lose_attempt(db, settings: Settings, job_id: str, worker_id: str, why: RankLost, usage: RunUsage) -> str:
    """A rank of the job died: this attempt is lost like a dead worker's. Its lease ends now and the reaper
    requeues the job (a retry from its last checkpoint; past its retry budget it fails), at once."""

    def run() -> None:
        with db.session() as s:
            jobs.end_lease(s, job_id, worker_id)
            usage.write(s)
            jobs.add_event(s, job_id, "log", f"{why}: this attempt is lost; retrying from the last checkpoint")

    try:
        with_db_retry(run, what="ending the lost attempt's lease")
    except jobs.LeaseLost:
        return "lease_lost"
    try:
        reap_once(settings)
    except Exception as exc:  # the reaper thread of any worker requeues it on its next round
        log.warning("could not requeue job %s now (%s); the reaper will", job_id, exc)
    return "rank_lost"


def _environment_files(environment: dict, work: Path, settings: Settings) -> tuple[str, str | None]:
    """The environment's items as the job's training and held-out files, generated by a grader-pool process
    (killed past GSPO_ENVIRONMENT_GENERATE_TIMEOUT_S, its memory capped, at most GSPO_ENVIRONMENT_MAX_BYTES):
    no thread of this process and no rank runs a tenant-configured generator, and every rank reads one copy."""
    policy = GraderPolicy.from_mapping(settings.grader_policy())
    timeout = settings.environment_generate_timeout_s
    isolation = Isolation(policy, timeout, "GSPO_ENVIRONMENT_GENERATE_TIMEOUT_S")
    train, held_out = str(work / "train.jsonl"), str(work / "val.jsonl")
    env = parse_environment(environment)
    assert isinstance(env, ReasoningGymEnvironment)  # the caller's: only a generated environment has items to write
    counts = write_environment_rows(
        env, train, held_out, isolation, settings.environment_max_bytes, settings.max_row_bytes
    )
    return train, held_out if counts[1] else None


def _train(
    db,
    objects: ObjectStore,
    settings: Settings,
    job_id: str,
    worker_id: str,
    usage: RunUsage,
    work: Path,
    runtime: RuntimeOptions,
) -> str:
    """Fetch the claimed job's inputs, train it (resuming from its checkpoint) and settle its status."""
    with Heartbeat(db, job_id, worker_id, settings.lease_seconds, settings.heartbeat_seconds, usage) as hb:
        # torch & co. load here, under the lease's heartbeat: a message that finds no job leaves without them.
        from gspo_core.trainer import train

        with db.session() as s:
            job = s.get(Job, job_id)
            hp, seed, reward, status = dict(job.hyperparameters), job.seed, job.reward, job.status
            tools = list(job.tools or [])
            environment = job.environment
            devices = job.devices
            model, train_path, val_path = _fetch_inputs(s, objects, job, work, settings.models_dir)
            resume = _resume_dir(s, objects, job_id, work / "output")
            if dropped := drop_orphan_uploads(s, objects, job_id):
                jobs.add_event(
                    s,
                    job_id,
                    "log",
                    f"removed {len(dropped)} checkpoint upload(s) a lost attempt left without a record",
                )
        reward = map_reward_models(reward, lambda m: resolve_model(settings.models_dir, m))
        if environment is not None and environment.get("type") == "reasoning_gym":  # a generated one
            train_path, val_path = _environment_files(environment, work, settings)
            environment = None  # its items are the job's files now
        spec = JobSpec(
            model=model,
            training_file=train_path,
            validation_file=val_path,
            environment=environment,
            reward=reward,
            tools=tools,
            hyperparameters=GSPOConfig.from_stored({**hp, "seed": seed}),
            resources=Resources(devices=devices),
            output_dir=str(work / "output"),
        )
        quota = settings.max_file_storage_bytes_per_tenant  # a checkpoint past it fails the job
        cb = PersistCallbacks(db, objects, job_id, worker_id, usage.attempt, SHUTDOWN, hb.lost, usage, quota)
        if status in ("cancelling", "pausing"):  # a takeover of a job asked to stop: nothing more to train
            cb.stop_reason = "cancel" if status == "cancelling" else "pause"
        else:
            if devices > 1:  # rank 0's vLLM engine runs in processes of its own (`gspo_core.launch`)
                allow_children()
            with other_ranks(spec, resume is not None, work, runtime):
                train(
                    spec,
                    cb,
                    resume_from=resume,
                    grader_policy=GraderPolicy.from_mapping(settings.grader_policy()),
                    runtime=runtime,
                )
        return _settle(db, objects, job_id, worker_id, cb, settings)


def run_job(job_id: str) -> str:
    """The body of the Celery task: run the job a free slot is given (see `_claim`). Returns what
    happened (for logs and tests)."""
    if SHUTDOWN.is_set():  # forked during its worker's warm shutdown: claiming would start an attempt the stop kills
        return "skipped"
    settings = get_settings()
    runtime = RuntimeOptions.from_mapping(settings.runtime_options())
    prepare_process(runtime)  # this process runs one job (a fresh pool child per task): its owner prepares it
    db, objects = get_db(settings), get_store(settings)
    worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    with db.session() as s:
        job = _claim(s, job_id, worker_id, settings)
        if job is None:
            return "skipped"  # its job runs elsewhere or is finished, and nothing else may run now
        limit, source = wall_limit(job.max_wall_seconds, settings)
        meter = RunMeter(QueuePolicy.of(settings), (job.device_seconds, job.tokens_sampled, job.tokens_trained))
        usage = RunUsage(job.id, job.tenant_id, worker_id, job.attempts, meter, limit, source)
        job_id = job.id
    if usage.over_limit():  # its earlier attempts used it all (e.g. a worker died at the limit)
        return _fail(db, objects, job_id, worker_id, usage.limit_error(job.step), usage)
    work = settings.data_dir / "work" / job_id
    shutil.rmtree(work, ignore_errors=True)
    private_dir(work)
    try:
        return _train(db, objects, settings, job_id, worker_id, usage, work, runtime)
    except jobs.LeaseLost as exc:
        log.warning("%s: stopped without writing further", exc)
        return "lease_lost"
    except RankLost as exc:
        log.warning("job %s: %s", job_id, exc)
        return _lose_attempt(db, settings, job_id, worker_id, exc, usage)
    except (
        JobInputError,
        DataError,
        ValidationError,
        ToolSpecError,
        EnvironmentSpecError,
    ) as exc:  # e.g. a tool server unreachable at start
        return _fail(db, objects, job_id, worker_id, f"invalid job input: {exc}", usage)
    except StorageQuotaExceeded as exc:
        return _fail(db, objects, job_id, worker_id, str(exc), usage)
    except OSError as exc:
        return _fail(
            db,
            objects,
            job_id,
            worker_id,
            str(exc) if "cannot load model" in str(exc) else f"could not read the job's inputs: {exc}",
            usage,
        )
    except Exception as exc:
        log.exception("job %s failed", job_id)
        return _fail(db, objects, job_id, worker_id, f"{type(exc).__name__}: {exc}", usage)
    finally:
        shutil.rmtree(work, ignore_errors=True)
