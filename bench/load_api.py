"""Bounded load test on loopback: N concurrent clients poll job status and metrics while a job writes
metrics. Reports p50/p99 latency and errors per poll interval.
``python -m bench.load_api [--clients 200] [--seconds 20] [--interval 1.0 0]``.

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


def _serve(env: dict, workers: int):
    """The API in its own process (as deployed), so the load generator does not share its GIL."""
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gspo_cli.main",
            "api",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            str(workers),
        ],
        env={**os.environ, **env},
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("API did not start")


def _writer(db, job_id: str, stop: threading.Event, every: float) -> None:
    from store import progress

    step = 0
    while not stop.wait(every):
        step += 1
        with db.session() as s:
            progress.record_step(s, job_id, step, {"reward/mean": step / 1000, "loss": 0.1})


class _Conn:
    """One keep-alive HTTP/1.1 connection on raw asyncio streams.

    httpx costs about a millisecond of client CPU per request: at a few hundred requests per second
    the load generator, not the server, used the core (measured: generator 100 %, server 25 %).
    This reads only what uvicorn sends (a status line, headers with Content-Length, the body).
    """

    def __init__(self, host: str, port: int, key: str) -> None:
        self.host, self.port, self.key = host, port, key
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {self.key}\r\n\r\n".encode()
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        body = await self.reader.readexactly(length)
        if status == 200:
            json.loads(body)  # a truncated or garbled body counts as an error, not a success
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def _client(conn: _Conn, job_id: str, until: float, interval: float, lat: list, errors: list) -> None:
    """Poll status and metrics alternately; ``interval`` seconds of think time after each answer."""
    import random

    i = random.randrange(2)
    await asyncio.sleep(random.uniform(0, interval))  # clients start spread over one interval
    while time.monotonic() < until:
        path = f"/v1/jobs/{job_id}" if i % 2 == 0 else f"/v1/jobs/{job_id}/metrics?after_step=0&limit=50"
        t0 = time.perf_counter()
        try:
            status = await asyncio.wait_for(conn.get(path), 30)
            (lat.append(time.perf_counter() - t0) if status == 200 else errors.append(status))
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            errors.append(type(exc).__name__)
            conn.close()
        i += 1
        if interval:
            await asyncio.sleep(interval)
    conn.close()


async def _load(url: str, key: str, job_id: str, clients: int, seconds: float, interval: float) -> tuple[list, list]:
    host, port = url.removeprefix("http://").split(":")
    lat: list[float] = []
    errors: list = []
    until = time.monotonic() + seconds
    await asyncio.gather(
        *(_client(_Conn(host, int(port), key), job_id, until, interval, lat, errors) for _ in range(clients))
    )
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


def _summary(lat: list, errors: list, clients: int, seconds: float, interval: float, steps: int) -> dict:
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [float("nan")] * 99
    return {
        "clients": clients,
        "poll_interval_s": interval,
        "seconds": seconds,
        "requests": len(lat) + len(errors),
        "errors": len(errors),
        "error_kinds": sorted({str(e) for e in errors}),
        "rps": round(len(lat) / seconds, 1),
        "p50_ms": round(q[49] * 1000, 1),
        "p99_ms": round(q[98] * 1000, 1),
        "max_ms": round(max(lat, default=float("nan")) * 1000, 1),
        "steps_written_meanwhile": steps,
    }


def _mark_running(db, job_id: str) -> None:
    from store.models import Job, utcnow

    with db.session() as s:
        job = s.get(Job, job_id)
        job.status, job.started_at = "running", utcnow()


def _job_step(db, job_id: str) -> int:
    from store.models import Job

    with db.session() as s:
        return s.get(Job, job_id).step


def _run(db_url: str, tmp: str, clients: int, seconds: float, intervals: list[float], workers: int) -> list[dict]:
    """One server and one job; a load phase per poll interval while a thread writes step metrics."""
    from gspo_core.toy import TOY_REWARD, write_toy_dataset
    from store.db import Database
    from store.tenants import create_tenant_and_key

    db = Database(db_url)
    proc, url = _serve({"GSPO_DATA_DIR": tmp, "DATABASE_URL": db_url, "GSPO_MODELS_DIR": f"{tmp}/models"}, workers)
    stop = threading.Event()
    writer = None
    reports = []
    try:
        with db.session() as s:
            _, key = create_tenant_and_key(s, f"load-{uuid.uuid4().hex[:6]}")
        h = {"Authorization": f"Bearer {key}"}
        data = write_toy_dataset(f"{tmp}/t.jsonl").read_bytes()
        fid = httpx.post(url + "/v1/files", headers=h, files={"file": ("t.jsonl", data)}).json()["id"]
        job_id = httpx.post(
            url + "/v1/jobs", headers=h, json={"model": "org/model", "training_file": fid, "reward": TOY_REWARD}
        ).json()["id"]
        _mark_running(db, job_id)  # no worker runs here: the writer thread plays a training job
        writer = threading.Thread(target=_writer, args=(db, job_id, stop, 0.2), daemon=True)
        writer.start()
        for interval in intervals:
            before = _job_step(db, job_id)
            lat, errors = _event_loop_run(_load(url, key, job_id, clients, seconds, interval))
            reports.append(_summary(lat, errors, clients, seconds, interval, _job_step(db, job_id) - before))
            print(json.dumps(reports[-1]), flush=True)
    finally:
        stop.set()
        if writer is not None:
            writer.join(5)
        proc.terminate()
        proc.wait(10)
        db.dispose()
    return reports


def _event_loop_run(coro):
    try:
        import uvloop  # the client's own CPU cost is part of what the 2 cores share

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from store.db import run_migrations

    ap = argparse.ArgumentParser(prog="python -m bench.load_api")
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=20, help="length of each load phase")
    ap.add_argument(
        "--interval",
        type=float,
        nargs="+",
        default=[1.0, 0.0],
        help="each client's think time between polls, one phase per value (0 = closed loop, "
        "no think time: a saturation test, not a polling client)",
    )
    ap.add_argument("--api-workers", type=int, default=2, help="`gspo api --workers` (server processes)")
    ap.add_argument("--json", help="also write the reports here")
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="gspo-load-")
    db_url, created = _setup_db(os.environ.get("DATABASE_URL"))
    try:
        run_migrations(db_url)
        reports = _run(db_url, tmp, a.clients, a.seconds, a.interval, a.api_workers)
    finally:
        _drop_db(created)
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(reports, f, indent=2)
    return 0 if not any(r["errors"] for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
