"""A run asked to pause: its callbacks stop it at the step boundary and its settle pauses it (or requeues it
when it was resumed meanwhile); a run that ends writes its results file once. On SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time

from store import jobs, results
from store.models import File, Job
from store.objects import LocalObjectStore
from store.usage import QueuePolicy, RunMeter
from tests.store.conftest import db, make_job  # noqa: F401 (db: a migrated SQLite and PostgreSQL database)
from worker.persist import PersistCallbacks, RunUsage
from worker.runner import _settle


def _running(database, job_id: str, objects) -> PersistCallbacks:
    with database.session() as s:
        jobs.claim(s, job_id, "w1", lease_seconds=60)
    cb = PersistCallbacks(database, objects, job_id, "w1", 1, threading.Event(), threading.Event())
    cb.on_step(1, {"reward/mean": 0.5})
    assert not cb.should_stop()
    with database.session() as s:
        jobs.request_pause(s, s.get(Job, job_id))
    assert cb.should_stop() and cb.stop_reason == "pause"
    return cb


def test_a_pausing_run_settles_paused_and_frees_its_worker(db, tmp_path):  # noqa: F811
    objects = LocalObjectStore(tmp_path)
    job_id = make_job(db)
    cb = _running(db, job_id, objects)
    cb.on_step(2, {"reward/mean": 0.75})  # the step in flight when the pause came is recorded
    assert _settle(db, objects, job_id, "w1", cb, settings=None) == "paused"
    with db.session() as s:
        job = s.get(Job, job_id)
        assert (job.status, job.step, job.attempts, job.worker_id) == ("paused", 2, 0, None)
        assert results.result_file_ids(s, job_id) == [], "a paused job has not ended"
        assert jobs.request_resume(s, job) is True
    with db.session() as s:
        assert jobs.claim(s, job_id, "w2", lease_seconds=60).status == "running"


def test_a_run_resumed_while_pausing_is_requeued_and_an_ended_one_gets_its_results_once(db, tmp_path):  # noqa: F811
    objects = LocalObjectStore(tmp_path)
    job_id = make_job(db)
    cb = _running(db, job_id, objects)
    with db.session() as s:
        jobs.request_resume(s, s.get(Job, job_id))  # pausing -> running before the worker settled
    assert _settle(db, objects, job_id, "w1", cb, settings=None) == "requeued"  # (no broker: the reaper resends)
    with db.session() as s:
        assert s.get(Job, job_id).status == "queued"
    cb = PersistCallbacks(db, objects, job_id, "w2", 2, threading.Event(), threading.Event())
    with db.session() as s:
        jobs.claim(s, job_id, "w2", lease_seconds=60)
    assert _settle(db, objects, job_id, "w2", cb, settings=None) == "succeeded"
    with db.session() as s:
        (file_id,) = results.result_file_ids(s, job_id)
        assert results.attach_committed(s, objects, job_id).id == file_id  # a second writer finds it
        assert objects.get_bytes(s.get(File, file_id).object_key).decode().splitlines()[1].startswith("1,0.5,")


def test_a_spent_budget_stops_a_run_mid_step_and_its_first_step_after_one_budget_at_most(db, tmp_path):  # noqa: F811
    """The trainer asks ``should_stop`` while a step waits (`gspo_core.stopping`): from the run's second step a
    spent budget stops it at the next ask; its first step (begun by the first ask) only once it has lasted a
    whole period's budget, so a run whose start-up outlasts the budget still progresses, and a first step that
    waits on a slow agent is bounded all the same."""
    objects = LocalObjectStore(tmp_path)
    job_id = make_job(db)
    with db.session() as s:
        job = jobs.claim(s, job_id, "w1", lease_seconds=60)
        tenant_id = job.tenant_id
    policy = QueuePolicy(period_s=3600, budget_s=1.5)
    usage = RunUsage(job_id, tenant_id, "w1", 1, RunMeter(policy, started=time.time() - 5))  # start-up: 5 s
    cb = PersistCallbacks(db, objects, job_id, "w1", 1, threading.Event(), threading.Event(), usage)
    with db.session() as s:
        usage.write(s)
    began = time.monotonic()
    assert not cb.should_stop(), "the first step begins although the start-up spent the budget"
    while not cb.should_stop():
        assert time.monotonic() - began < 10, "the first step is stopped after one budget"
        time.sleep(0.1)
    assert cb.stop_reason == "budget" and time.monotonic() - began >= policy.budget_s
    assert cb.budget is not None and cb.budget.exhausted

    cb = PersistCallbacks(db, objects, job_id, "w1", 1, threading.Event(), threading.Event(), usage)
    cb.on_step(1, {"reward/mean": 0.5})
    assert cb.should_stop() and cb.stop_reason == "budget", "from the second step at once"


def test_an_ended_run_commits_its_results_file_with_its_outcome_and_an_object_store_outage_leaves_the_outcome(
    db,  # noqa: F811
    tmp_path,
):
    """The results file is written inside the transaction that ends the job: a reader never sees it succeeded
    without its file (a client polled in between and found ``result_files == []``). With the object store
    down, the job still ends, without the file, and the reaper's sweep lists it."""
    seen: list[str] = []

    class Watching(LocalObjectStore):
        def put_bytes(self, key: str, data: bytes) -> None:
            reader = db.read_session()
            try:  # another connection: what the job's row says before the settle's commit
                seen.append(reader.get(Job, job_id).status)
            finally:
                reader.close()
            super().put_bytes(key, data)

    class Down(LocalObjectStore):
        def put_bytes(self, key: str, data: bytes) -> None:
            raise OSError("object store unreachable")

    for objects, files in ((Watching(tmp_path / "up"), 1), (Down(tmp_path / "down"), 0)):
        job_id = make_job(db)
        with db.session() as s:
            jobs.claim(s, job_id, "w1", lease_seconds=60)
        cb = PersistCallbacks(db, objects, job_id, "w1", 1, threading.Event(), threading.Event())
        cb.on_step(1, {"reward/mean": 0.5})
        assert _settle(db, objects, job_id, "w1", cb, settings=None) == "succeeded"
        with db.session() as s:
            assert s.get(Job, job_id).status == "succeeded"
            assert len(results.result_file_ids(s, job_id)) == files
            assert (job_id in results.jobs_without_results(s)) == (files == 0)
    assert seen == ["running"], "the file was written before the commit that ended the job"
