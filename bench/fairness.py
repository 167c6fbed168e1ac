"""Fairness under a hostile tenant: while one tenant runs the worst it can at its caps (dry runs of a
CPU-burning python grader in a loop, the most event streams it may open and then some, large uploads
back to back), another tenant's status and metrics polls and ``/healthz`` are timed.
``python -m bench.fairness [--seconds 20] [--victims 20] [--api-workers 2] [--redis-url URL]``.

PostgreSQL at $DATABASE_URL (default: a fresh database on 127.0.0.1:5432), ``gspo api`` in its own
process; only 127.0.0.1 is contacted. One phase without the hostile tenant, then one with it.
Targets on a 2-core machine: p99 < 100 ms for polls, < 50 ms for /healthz. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter

import httpx

from bench.load_api import _Conn, _drop_db, _event_loop_run, _serve, _setup_db, _writer

BURN = {
    "type": "python",
    "name": "burn",
    "timeout_s": 1.0,
    "source": "def grade(sample, item):\n    x = 0\n    while True:\n        x += 1\n",
}


def _quantiles(lat: list[float], errors: list) -> dict:
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [float("nan")] * 99
    return {
        "n": len(lat),
        "errors": len(errors),
        "error_kinds": sorted({str(e) for e in errors}),
        "p50_ms": round(q[49] * 1000, 1),
        "p99_ms": round(q[98] * 1000, 1),
        "max_ms": round(max(lat, default=float("nan")) * 1000, 1),
    }


async def _poller(conn: _Conn, path: str, until: float, interval: float, lat: list, errors: list) -> None:
    import random

    await asyncio.sleep(random.uniform(0, interval))
    while time.monotonic() < until:
        t0 = time.perf_counter()
        try:
            status = await asyncio.wait_for(conn.get(path), 30)
            (lat.append(time.perf_counter() - t0) if status == 200 else errors.append(status))
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            errors.append(type(exc).__name__)
            conn.close()
        await asyncio.sleep(interval)
    conn.close()


async def _victim(url: str, key: str, job_id: str, clients: int, interval: float, until: float) -> dict:
    host, port = url.removeprefix("http://").split(":")
    out = {kind: ([], []) for kind in ("status", "metrics", "healthz")}
    tasks = []
    for i in range(clients):
        kind = "status" if i % 2 == 0 else "metrics"
        path = f"/v1/jobs/{job_id}" if kind == "status" else f"/v1/jobs/{job_id}/metrics?after_step=0&limit=50"
        tasks.append(_poller(_Conn(host, int(port), key), path, until, interval, *out[kind]))
    tasks.append(_poller(_Conn(host, int(port), key), "/healthz", until, 0.1, *out["healthz"]))
    await asyncio.gather(*tasks)
    return {kind: _quantiles(lat, errors) for kind, (lat, errors) in out.items()}


async def _hostile_runs(http: httpx.AsyncClient, h: dict, until: float, seen: Counter, samples: int) -> None:
    body = {"reward": BURN, "item": {}, "samples": ["x"] * samples}
    while time.monotonic() < until:
        try:
            r = await http.post("/v1/rewards/run", json=body, headers=h, timeout=120)
            seen[f"reward_run {r.status_code}"] += 1
            if r.status_code != 200:
                await asyncio.sleep(0.1)  # a hostile client retries at once, not after Retry-After
        except httpx.HTTPError as exc:
            seen[f"reward_run {type(exc).__name__}"] += 1


async def _hostile_stream(http: httpx.AsyncClient, h: dict, job_id: str, until: float, seen: Counter) -> None:
    while time.monotonic() < until:
        try:
            async with http.stream("GET", f"/v1/jobs/{job_id}/events", headers=h, timeout=30) as r:
                seen[f"stream {r.status_code}"] += 1
                if r.status_code != 200:
                    await asyncio.sleep(0.2)
                    continue
                async for _ in r.aiter_lines():
                    if time.monotonic() > until:
                        break
                seen["stream ended"] += 1
        except httpx.HTTPError as exc:
            seen[f"stream {type(exc).__name__}"] += 1


async def _hostile_uploads(http: httpx.AsyncClient, h: dict, path: str, until: float, seen: Counter) -> None:
    while time.monotonic() < until:
        try:
            with open(path, "rb") as f:
                r = await http.post("/v1/files", headers=h, files={"file": ("big.jsonl", f)}, timeout=300)
            seen[f"upload {r.status_code}"] += 1
            if r.status_code == 201:
                await http.delete(f"/v1/files/{r.json()['id']}", headers=h)
            else:
                await asyncio.sleep(0.1)
        except httpx.HTTPError as exc:
            seen[f"upload {type(exc).__name__}"] += 1


async def _hostile(
    url: str, key: str, job_id: str, upload_path: str, until: float, caps: dict, kinds: set[str], samples: int
) -> dict:
    """One more client of each kind than the tenant's cap allows, so that the cap is always full."""
    seen: Counter = Counter()
    h = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, limits=limits) as http:
        tasks = [_hostile_runs(http, h, until, seen, samples) for _ in range(caps["runs"] + 1) if "runs" in kinds]
        tasks += [
            _hostile_stream(http, h, job_id, until, seen) for _ in range(caps["streams"] + 2) if "streams" in kinds
        ]
        tasks += [
            _hostile_uploads(http, h, upload_path, until, seen)
            for _ in range(caps["uploads"] + 1)
            if "uploads" in kinds
        ]
        await asyncio.gather(*tasks)
    return dict(sorted(seen.items()))


def _hostile_process(
    url: str, key: str, job_id: str, upload_path: str, seconds: float, kinds: str, samples: int, out
) -> None:
    """The hostile tenant in a process of its own: its client work must not delay the victim's timer."""
    from store.settings import Settings

    defaults = {name: f.default for name, f in Settings.model_fields.items()}  # what the server runs with
    caps = {
        "runs": defaults["max_reward_runs_per_tenant"],
        "streams": defaults["max_streams_per_tenant"],
        "uploads": defaults["max_uploads_per_tenant"],
    }
    until = time.monotonic() + seconds
    out.put(_event_loop_run(_hostile(url, key, job_id, upload_path, until, caps, set(kinds.split(",")), samples)))


def _phase(url: str, keys: dict, jobs: dict, args, upload_path: str, hostile: bool) -> dict:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = None
    if hostile:
        proc = ctx.Process(
            target=_hostile_process,
            args=(
                url,
                keys["hostile"],
                jobs["hostile"],
                upload_path,
                args.seconds + 2,
                args.hostile,
                args.run_samples,
                out,
            ),
        )
        proc.start()
        time.sleep(2)  # it opens its streams and starts its first runs and uploads
    until = time.monotonic() + args.seconds
    report = {
        "victim": _event_loop_run(_victim(url, keys["victim"], jobs["victim"], args.victims, args.interval, until))
    }
    if proc is not None:
        report["hostile_requests"] = out.get(timeout=600)
        proc.join(60)
    return report


def _prepare(db, tmp: str, upload_mb: int) -> tuple[dict, dict, str]:
    """Two tenants with a running job each (a thread plays their workers), and the upload file."""
    from gspo_core.toy import TOY_REWARD
    from store import jobs
    from store.models import File, utcnow
    from store.tenants import create_tenant_and_key

    keys, job_ids = {}, {}
    with db.session() as s:
        for name in ("victim", "hostile"):
            tenant, keys[name] = create_tenant_and_key(s, f"{name}-{uuid.uuid4().hex[:6]}")
            f = File(
                tenant_id=tenant.id,
                filename="t.jsonl",
                bytes=1,
                rows=1,
                object_key=f"tenants/{tenant.id}/x",
                item_fields=["prompt", "answer"],
            )
            s.add(f)
            s.flush()
            job = jobs.create_job(
                s,
                tenant_id=tenant.id,
                model="org/model",
                training_file_id=f.id,
                reward=TOY_REWARD,
                hyperparameters={},
                total_steps=100_000,
            )
            job.status, job.started_at = "running", utcnow()
            job_ids[name] = job.id
    path = os.path.join(tmp, "big.jsonl")
    row = json.dumps({"prompt": "p" * 900, "answer": "a" * 60}) + "\n"
    with open(path, "w") as f:
        f.write(row * (upload_mb * 2**20 // len(row)))
    return keys, job_ids, path


def run(db_url: str, tmp: str, args) -> list[dict]:
    from store.db import Database

    db = Database(db_url)
    env = {
        "GSPO_DATA_DIR": tmp,
        "DATABASE_URL": db_url,
        "GSPO_MODELS_DIR": f"{tmp}/models",
        "GSPO_MAX_UPLOAD_BYTES": str((args.upload_mb + 1) * 2**20),
    }
    if args.redis_url:
        env["REDIS_URL"] = args.redis_url
    keys, job_ids, upload_path = _prepare(db, tmp, args.upload_mb)
    proc, url = _serve(env, args.api_workers)
    stop = threading.Event()
    writers = [threading.Thread(target=_writer, args=(db, j, stop, 0.5), daemon=True) for j in job_ids.values()]
    reports = []
    try:
        for w in writers:
            w.start()
        for hostile in (False, True):
            report = {
                "phase": f"hostile tenant at its caps ({args.hostile})" if hostile else "baseline",
                "seconds": args.seconds,
                "victim_clients": args.victims,
                "poll_interval_s": args.interval,
                "api_workers": args.api_workers,
                "limiter": "redis" if args.redis_url else "per process",
                **_phase(url, keys, job_ids, args, upload_path, hostile),
            }
            reports.append(report)
            print(json.dumps(report), flush=True)
    finally:
        stop.set()
        proc.terminate()  # in-flight dry runs are killed by their handlers as the server stops
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        db.dispose()
    return reports


def main(argv: list[str] | None = None) -> int:
    from store.db import run_migrations

    ap = argparse.ArgumentParser(prog="python -m bench.fairness")
    ap.add_argument("--seconds", type=float, default=20, help="length of each phase")
    ap.add_argument("--victims", type=int, default=20, help="the other tenant's polling clients")
    ap.add_argument("--interval", type=float, default=0.5, help="each victim client's think time between polls")
    ap.add_argument("--api-workers", type=int, default=2, help="`gspo api --workers`")
    ap.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="Redis for the limiter (caps shared by the server processes); default per process",
    )
    ap.add_argument("--upload-mb", type=int, default=32, help="size of each of the hostile tenant's uploads")
    ap.add_argument("--run-samples", type=int, default=64, help="samples per hostile dry run (each burns 1 s)")
    ap.add_argument("--hostile", default="runs,streams,uploads", help="what the hostile tenant does (a subset)")
    ap.add_argument("--json", help="also write the reports here")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="gspo-fairness-")
    db_url, created = _setup_db(os.environ.get("DATABASE_URL"))
    try:
        run_migrations(db_url)
        reports = run(db_url, tmp, args)
    finally:
        _drop_db(created)
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)
    return 0 if not any(r["victim"][k]["errors"] for r in reports for k in r["victim"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
