"""Readiness (database, broker, the sandbox of python graders, live workers) and the Prometheus scrape."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import get_args

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from sqlalchemy import func, select, text

from api.job_schemas import JobStatus
from api.schemas import ReadyOut
from gspo_core.rewards import GraderPolicy
from gspo_core.rewards.isolation import isolation_for
from store import workers
from store.db import Database
from store.models import Job
from store.queue import broker_reachable
from store.settings import Settings


def _workers_alive(settings: Settings) -> int:
    try:
        return len(workers.alive(settings))
    except Exception:  # Redis down: the broker check says so
        return 0


def _database_ok(db: Database) -> bool:
    try:
        with db.session() as s:
            s.execute(text("SELECT 1"))
        return True
    except Exception:
        return False


async def readiness(db: Database, settings: Settings) -> tuple[ReadyOut, bool]:
    """What each dependency answers, and whether the API can serve (database and broker reachable)."""
    db_ok, broker_ok, iso, n_workers = await asyncio.gather(
        asyncio.to_thread(_database_ok, db),
        asyncio.to_thread(broker_reachable, settings),
        asyncio.to_thread(isolation_for, GraderPolicy.from_mapping(settings.grader_policy())),
        asyncio.to_thread(_workers_alive, settings),
    )
    # Python graders: "bubblewrap" (isolated), "weak" (the operator allowed rlimits only) or "refused".
    out = ReadyOut(
        database="ok" if db_ok else "unreachable",
        broker="ok" if broker_ok else "unreachable",
        sandbox=iso.mode,
        sandbox_reason=iso.summary if iso.reason else None,
        worker="ok" if n_workers else "missing",
        workers=n_workers,
    )
    return out, db_ok and broker_ok


@dataclass(frozen=True)
class Monitoring:
    """The process's Prometheus registry, and the gauge of jobs by status that each scrape refreshes."""

    registry: CollectorRegistry
    jobs: Gauge
    db: Database

    def scrape(self) -> bytes:
        """Prometheus text of every metric, the job counts read now."""
        with self.db.session() as s:
            counts = dict(s.execute(select(Job.status, func.count()).group_by(Job.status)).all())
        for status in get_args(JobStatus):
            self.jobs.labels(status).set(counts.get(status, 0))
        return generate_latest(self.registry)
