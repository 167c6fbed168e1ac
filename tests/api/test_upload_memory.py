"""A ~60 MB upload to a real server process: streamed to disk and validated line by line (in a child
process), so the server's memory stays bounded (it grew by ~1.6 GB when the body was held and
parsed whole); a supervised job refused over it reads it a line at a time too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import psutil

from store.db import Database, run_migrations
from store.tenants import create_tenant_and_key
from tests.e2e.test_service_e2e import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Generous: the spooled part, a line at a time, the copy buffers and allocator slack.
MAX_GROWTH_MB = 200
#: A line at a time and a chunk of the stored object (1 MiB), with slack; the whole file is 60 MB.
MAX_SFT_CHECK_GROWTH_MB = 25


def _dataset(path, target_bytes: int) -> int:
    """Rows that are prompts and supervised chats both, but for the last, which has no assistant turn: a
    supervised job's check reads the whole file before it refuses it."""
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    row = json.dumps({"prompt": "p" * 900, "answer": "a" * 60, "n": 12345, "x": 1.5, "messages": chat}) + "\n"
    rows = target_bytes // len(row)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(row)
        f.write(json.dumps({"prompt": "p", "answer": "a", "n": 1, "x": 1.5, "messages": chat[:1]}) + "\n")
    return rows + 1


def _peak_growth_mb(server: psutil.Process, call) -> tuple[float, object]:
    """``(MB the server's RSS grew at most while call() ran, call()'s result)``, sampled every 10 ms."""
    base = server.memory_info().rss
    peak, stop = [base], threading.Event()

    def sample() -> None:
        while not stop.wait(0.01):
            peak[0] = max(peak[0], server.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = call()
    finally:
        stop.set()
        sampler.join()
    return (peak[0] - base) / 2**20, result


def test_a_60_mb_upload_keeps_server_memory_bounded(tmp_path):
    url_db = f"sqlite:///{tmp_path / 'gspo.db'}"
    run_migrations(url_db)
    db = Database(url_db)
    with db.session() as s:
        _, key = create_tenant_and_key(s, "big")
    db.dispose()
    rows = _dataset(tmp_path / "big.jsonl", 60 * 1024 * 1024)
    port = free_port()
    env = {**os.environ, "GSPO_DATA_DIR": str(tmp_path), "DATABASE_URL": url_db, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gspo_cli.main", "api", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url, h = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the API did not start"
            time.sleep(0.2)
        server = psutil.Process(proc.pid)
        small = httpx.post(url + "/v1/files", headers=h, files={"file": ("s.jsonl", b'{"prompt": "a"}\n')})
        assert small.status_code == 201, small.text  # warms every code path an upload takes

        def upload():
            with open(tmp_path / "big.jsonl", "rb") as f:
                return httpx.post(url + "/v1/files", headers=h, files={"file": ("big.jsonl", f)}, timeout=300)

        growth_mb, r = _peak_growth_mb(server, upload)
        assert r.status_code == 201, r.text
        assert r.json()["rows"] == rows and r.json()["bytes"] == (tmp_path / "big.jsonl").stat().st_size
        print(f"server RSS +{growth_mb:.0f} MB during a {r.json()['bytes'] / 2**20:.0f} MB upload")
        assert growth_mb < MAX_GROWTH_MB
        # A supervised job over it is refused at its last line, the file read a line at a time (loaded
        # whole, each refusal cost the file's size in memory; concurrent ones, a multiple).
        job = {"model": "toy", "training_file": r.json()["id"], "hyperparameters": {"method": "supervised"}}
        growth_mb, r = _peak_growth_mb(server, lambda: httpx.post(url + "/v1/jobs", headers=h, json=job, timeout=300))
        assert r.status_code == 422 and r.json()["error"]["line"] == rows, r.text
        assert r.json()["error"]["field"] == "training_file.messages"
        print(f"server RSS +{growth_mb:.0f} MB while refusing a supervised job over it")
        assert growth_mb < MAX_SFT_CHECK_GROWTH_MB
        # A large file is validated in a child process: a bad row still names its line, leaves nothing.
        bad = (tmp_path / "big.jsonl").read_bytes()[: 2 * 2**20].rsplit(b"\n", 1)[0] + b'\n{"prompt": "x", "v": NaN}\n'
        r = httpx.post(url + "/v1/files", headers=h, files={"file": ("bad.jsonl", bad)}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["line"] == bad.count(b"\n"), r.text
        assert r.json()["error"]["field"] == "v"
        assert len(httpx.get(url + "/v1/files", headers=h).json()["data"]) == 2
        assert len(list((tmp_path / "objects").rglob("*.jsonl"))) == 2
    finally:
        proc.terminate()
        proc.wait(20)
