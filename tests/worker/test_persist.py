"""Fencing of a worker's writes by its lease, on real PostgreSQL: a worker that lost its job writes nothing."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url

from store import jobs
from store.db import Database
from store.models import Checkpoint, Job, StepMetric
from store.objects import LocalObjectStore, put_dir
from store.tenants import StorageQuotaExceeded, stored_bytes
from tests.conftest import truncate_all
from tests.store.conftest import make_job
from worker.persist import PersistCallbacks, drop_orphan_uploads
from worker.runner import _fail, _settle


@pytest.fixture()
def db(pg_database):
    truncate_all(pg_database)
    database = Database(pg_database)
    yield database
    database.dispose()


def _callbacks(db, objects, job_id: str, worker_id: str, attempt: int) -> PersistCallbacks:
    return PersistCallbacks(db, objects, job_id, worker_id, attempt, threading.Event(), threading.Event())


def _checkpoint_dir(tmp_path, name: str):
    d = tmp_path / name / "model"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    return d.parent


def test_a_worker_that_lost_its_job_writes_nothing_more(db, tmp_path):
    objects = LocalObjectStore(tmp_path / "objects")
    job_id = make_job(db)
    with db.session() as s:
        jobs.claim(s, job_id, "w1", lease_seconds=60)
    old = _callbacks(db, objects, job_id, "w1", 1)
    old.on_step(1, {"reward/mean": 0.1})
    with db.session() as s:  # w1 stalled past its lease (or lost the database); w2 took the job over
        s.get(Job, job_id).lease_until = jobs._now().replace(year=2000)
    with db.session() as s:
        assert jobs.claim(s, job_id, "w2", lease_seconds=60) is not None

    with pytest.raises(jobs.LeaseLost):
        old.on_step(2, {"reward/mean": 0.9})
    assert old.lease_lost.is_set() and old.stop_reason == "lease_lost"
    with pytest.raises(jobs.LeaseLost):
        old.on_checkpoint(2, str(_checkpoint_dir(tmp_path, "old")), final=False)
    assert old.should_stop()
    with pytest.raises(jobs.LeaseLost):
        _callbacks(db, objects, job_id, "w1", 1).should_stop()  # before its heartbeat noticed
    assert objects.list(f"jobs/{job_id}/") == [], "nothing uploaded by the worker that lost the job"
    assert _fail(db, objects, job_id, "w1", "RuntimeError: boom") == "lease_lost"
    with pytest.raises(jobs.LeaseLost):
        _settle(db, objects, job_id, "w1", _callbacks(db, objects, job_id, "w1", 1), settings=None)

    new = _callbacks(db, objects, job_id, "w2", 2)
    new.on_step(2, {"reward/mean": 0.2})
    new.on_checkpoint(2, str(_checkpoint_dir(tmp_path, "new")), final=False)
    with db.session() as s:
        job = s.get(Job, job_id)
        assert (job.status, job.worker_id, job.error, job.step) == ("running", "w2", None, 2)
        rows = s.execute(
            select(StepMetric.step, StepMetric.metrics).where(StepMetric.job_id == job_id).order_by(StepMetric.step)
        ).all()
        assert [(r.step, r.metrics["reward/mean"]) for r in rows] == [(1, 0.1), (2, 0.2)]
        ckpt = s.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id))
        assert ckpt.object_prefix == f"jobs/{job_id}/checkpoints/step-000002-a2"
    # w1 had uploaded step 3 before it died, but never wrote its row: w2's next attempt cleans that up.
    put_dir(objects, f"jobs/{job_id}/checkpoints/step-000003-a1", _checkpoint_dir(tmp_path, "lost"))
    with db.session() as s:
        assert drop_orphan_uploads(s, objects, job_id) == [f"jobs/{job_id}/checkpoints/step-000003-a1"]
    assert {k.split("/")[3] for k, _ in objects.list(f"jobs/{job_id}/")} == {"step-000002-a2"}
    assert _settle(db, objects, job_id, "w2", new, settings=None) == "succeeded"


class _Link:
    """A TCP relay to PostgreSQL that can be cut: the worker's database connection really goes away."""

    def __init__(self, host: str, port: int) -> None:
        self.target, self.up, self.socks = (host, port), threading.Event(), []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if not self.up.is_set():
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            self.socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            sock.close()

    def cut(self) -> None:
        self.up.clear()
        for sock in self.socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.cut()
        self.server.close()


def test_a_checkpoint_past_the_storage_quota_fails_its_job_and_is_not_kept(db, tmp_path):
    """Checkpoints count in the tenant's storage quota with its files: one that would take the tenant past it
    is not kept (its row rolled back, its objects removed) and the job fails saying so; earlier ones stay."""
    objects = LocalObjectStore(tmp_path / "objects")
    job_id = make_job(db)
    with db.session() as s:
        jobs.claim(s, job_id, "w1", lease_seconds=60)
        tenant_id = s.get(Job, job_id).tenant_id
        files = stored_bytes(s, tenant_id)
    src = _checkpoint_dir(tmp_path, "c")
    (src / "model" / "weights.bin").write_bytes(b"\0" * 10_000)
    quota = files + 15_000
    cb = PersistCallbacks(db, objects, job_id, "w1", 1, threading.Event(), threading.Event(), storage_quota=quota)
    cb.on_step(1, {"reward/mean": 0.1})
    cb.on_checkpoint(1, str(src), final=False)
    with db.session() as s:
        assert stored_bytes(s, tenant_id) == files + 10_002
    cb.on_step(2, {"reward/mean": 0.2})
    with pytest.raises(StorageQuotaExceeded) as exc:
        cb.on_checkpoint(2, str(src), final=False)
    assert f"{files + 20_004} of the {quota} bytes" in str(exc.value)
    with db.session() as s:
        assert list(s.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id))) == [1]
        assert stored_bytes(s, tenant_id) == files + 10_002
    assert objects.list(f"jobs/{job_id}/checkpoints/step-000002-a1") == []
    assert objects.list(f"jobs/{job_id}/checkpoints/step-000001-a1") != []
    assert _fail(db, objects, job_id, "w1", str(exc.value)) == "failed"
    with db.session() as s:
        assert s.get(Job, job_id).error.startswith("storage quota exceeded")


def test_a_finished_run_waits_out_a_database_outage_instead_of_failing(pg_database, db, tmp_path):
    url = make_url(pg_database)
    link = _Link(url.host, url.port or 5432)
    link.up.set()
    relayed = Database(url.set(host="127.0.0.1", port=link.port).render_as_string(hide_password=False))
    try:
        job_id = make_job(relayed)
        with relayed.session() as s:
            jobs.claim(s, job_id, "w1", lease_seconds=600)
        cb = _callbacks(relayed, LocalObjectStore(tmp_path), job_id, "w1", 1)
        cb.on_step(1, {"reward/mean": 0.5})
        link.cut()  # the database goes away just as the run finishes
        outcome: list[str] = []
        t = threading.Thread(
            target=lambda: outcome.append(_settle(relayed, cb.objects, job_id, "w1", cb, settings=None))
        )
        t.start()
        t.join(2.0)
        assert t.is_alive(), "settling must wait for the database, not give up"
        link.up.set()
        t.join(60)
        assert outcome == ["succeeded"]
        with db.session() as s:
            assert s.get(Job, job_id).status == "succeeded"
    finally:
        relayed.dispose()
        link.close()
