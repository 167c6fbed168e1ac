"""Bounded load test on loopback: N concurrent clients poll job status and metrics while a job writes
metrics. Reports p50/p99 latency and errors. ``python -m bench.load_api [--clients 200] [--seconds 20]``.

Uses PostgreSQL at $DATABASE_URL (default: a fresh database on 127.0.0.1:5432) and a real uvicorn
server; only 127.0.0.1 is contacted. A benchmark, not a timed test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import threading
import time
import uuid

import httpx

ADMIN_PG = "postgresql://postgres@127.0.0.1:5432/postgres"


def _serve(env: dict):
    """The API in its own process (as deployed), so the load generator does not share its GIL."""
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "gspo_cli.main", "api", "--host", "127.0.0.1", "--port", str(port)],
                            env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("API did not start")


def _writer(db, job_id: str, stop: threading.Event, every: float) -> None:
    from store import jobs

    step = 0
    while not stop.wait(every):
        step += 1
        with db.session() as s:
            jobs.record_step(s, job_id, step, {"reward/mean": step / 1000, "loss": 0.1})


async def _client(c: httpx.AsyncClient, job_id: str, until: float, lat: list, errors: list) -> None:
    i = 0
    while time.monotonic() < until:
        path = f"/v1/jobs/{job_id}" if i % 2 == 0 else f"/v1/jobs/{job_id}/metrics?after_step=0&limit=50"
        t0 = time.perf_counter()
        try:
            r = await c.get(path)
            (lat if r.status_code == 200 else errors).append(time.perf_counter() - t0 if r.status_code == 200 else r.status_code)
        except httpx.HTTPError as exc:
            errors.append(type(exc).__name__)
        i += 1


async def _load(url: str, key: str, job_id: str, clients: int, seconds: float) -> tuple[list, list]:
    lat: list[float] = []
    errors: list = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, limits=limits,
                                 timeout=30) as c:
        until = time.monotonic() + seconds
        await asyncio.gather(*(_client(c, job_id, until, lat, errors) for _ in range(clients)))
    return lat, errors


def _setup_db(url: str | None) -> tuple[str, str | None]:
    """``(url, name of a database we created and must drop)``."""
    if url:
        return url, None
    import psycopg

    name = f"gspo_load_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_PG, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}", name


def _drop_db(name: str | None) -> None:
    if name:
        import psycopg

        with psycopg.connect(ADMIN_PG, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _run(db_url: str, tmp: str, clients: int, seconds: float) -> dict:
    from gspo_core.toy import TOY_REWARD, write_toy_dataset
    from store.db import Database
    from store.tenants import create_tenant_and_key

    db = Database(db_url)
    proc, url = _serve({"GSPO_DATA_DIR": tmp, "DATABASE_URL": db_url, "GSPO_MODELS_DIR": f"{tmp}/models"})
    stop = threading.Event()
    writer = None
    try:
        with db.session() as s:
            _, key = create_tenant_and_key(s, f"load-{uuid.uuid4().hex[:6]}")
        h = {"Authorization": f"Bearer {key}"}
        data = write_toy_dataset(f"{tmp}/t.jsonl").read_bytes()
        fid = httpx.post(url + "/v1/files", headers=h, files={"file": ("t.jsonl", data)}).json()["id"]
        job_id = httpx.post(url + "/v1/jobs", headers=h,
                            json={"model": "org/model", "training_file": fid, "reward": TOY_REWARD}).json()["id"]
        writer = threading.Thread(target=_writer, args=(db, job_id, stop, 0.2), daemon=True)
        writer.start()
        lat, errors = asyncio.run(_load(url, key, job_id, clients, seconds))
        with db.session() as s:
            from store.models import Job

            steps_written = s.get(Job, job_id).step
    finally:
        stop.set()
        if writer is not None:
            writer.join(5)
        proc.terminate()
        proc.wait(10)
        db.dispose()
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [float("nan")] * 99
    return {"clients": clients, "seconds": seconds, "requests": len(lat) + len(errors), "errors": len(errors),
            "error_kinds": sorted({str(e) for e in errors}), "rps": round(len(lat) / seconds, 1),
            "p50_ms": round(q[49] * 1000, 1), "p99_ms": round(q[98] * 1000, 1), "max_ms": round(max(lat) * 1000, 1),
            "steps_written_meanwhile": steps_written}


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from store.db import run_migrations

    ap = argparse.ArgumentParser(prog="python -m bench.load_api")
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=20)
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="gspo-load-")
    db_url, created = _setup_db(os.environ.get("DATABASE_URL"))
    try:
        run_migrations(db_url)
        report = _run(db_url, tmp, a.clients, a.seconds)
    finally:
        _drop_db(created)
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
