"""`Client`: files, jobs, metrics, events (SSE), samples, checkpoints and reward runs over HTTP."""

from __future__ import annotations

import json
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx


class ApiError(Exception):
    """An error answer of the API, with its type, message and the field (and line) it names."""

    def __init__(self, status: int, type_: str, message: str, field: str | None = None, line: int | None = None):
        self.status, self.type, self.message, self.field, self.line = status, type_, message, field, line
        where = f" [field {field}" + (f", line {line}" if line else "") + "]" if field or line else ""
        super().__init__(f"{status} {type_}: {message}{where}")


class Client:
    """``Client(base_url, api_key)``; every method raises :class:`ApiError` on a 4xx/5xx answer."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _check(resp: httpx.Response) -> httpx.Response:
        if resp.status_code < 400:
            return resp
        try:
            err = resp.json()["error"]
            raise ApiError(
                resp.status_code, err.get("type", "error"), err.get("message", ""), err.get("field"), err.get("line")
            )
        except (ValueError, KeyError, TypeError):
            raise ApiError(resp.status_code, "http_error", resp.text[:500] or resp.reason_phrase) from None

    def _get(self, path: str, **params) -> Any:
        return self._check(self.http.get(path, params={k: v for k, v in params.items() if v is not None})).json()

    # --- files ---------------------------------------------------------------------------
    def upload_file(self, path: str | Path) -> dict:
        p = Path(path)
        with open(p, "rb") as f:
            return self._check(self.http.post("/v1/files", files={"file": (p.name, f, "application/jsonl")})).json()

    def list_files(self) -> list[dict]:
        return self._get("/v1/files")["data"]

    def delete_file(self, file_id: str) -> None:
        self._check(self.http.delete(f"/v1/files/{file_id}"))

    # --- jobs ----------------------------------------------------------------------------
    def create_job(
        self,
        *,
        model: str,
        training_file: str | None = None,
        reward: dict | None = None,
        hyperparameters: dict | None = None,
        validation_file: str | None = None,
        name: str | None = None,
        metadata: dict | None = None,
        seed: int = 0,
        idempotency_key: str | None = None,
        max_wall_seconds: int | None = None,
        tools: list[dict] | None = None,
        environment: dict | None = None,
    ) -> dict:
        """A new job: trained on ``training_file`` (a file id), or on ``environment`` instead (its items,
        ``{"type": "reasoning_gym", "tasks": [...]}``, or a tenant's OpenEnv server's episodes,
        ``{"type": "openenv", "url": ..., "headers": {...}}``: docs/environments.md)."""
        body: dict = {
            "model": model,
            "reward": reward,
            "hyperparameters": hyperparameters or {},
            "seed": seed,
            "metadata": metadata or {},
        }
        if training_file:
            body["training_file"] = training_file
        if validation_file:
            body["validation_file"] = validation_file
        if environment:
            body["environment"] = environment
        if name:
            body["name"] = name
        if max_wall_seconds is not None:
            body["max_wall_seconds"] = max_wall_seconds
        if tools:
            body["tools"] = tools
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._check(self.http.post("/v1/jobs", json=body, headers=headers)).json()

    def list_jobs(self, status: str | None = None, limit: int = 50, cursor: str | None = None) -> dict:
        return self._get("/v1/jobs", status=status, limit=limit, cursor=cursor)

    def get_job(self, job_id: str) -> dict:
        return self._get(f"/v1/jobs/{job_id}")

    def get_environment(self, job_id: str, samples: int = 3) -> dict:
        """The job's environment and its first ``samples`` training items."""
        return self._get(f"/v1/jobs/{job_id}/environment", samples=samples)

    def cancel_job(self, job_id: str) -> dict:
        return self._check(self.http.post(f"/v1/jobs/{job_id}/cancel")).json()

    def pause_job(self, job_id: str) -> dict:
        """Queued: paused at once; running: ``pausing`` until it checkpointed at its next step (then ``paused``)."""
        return self._check(self.http.post(f"/v1/jobs/{job_id}/pause")).json()

    def resume_job(self, job_id: str) -> dict:
        """A paused job is queued again and continues from its latest checkpoint."""
        return self._check(self.http.post(f"/v1/jobs/{job_id}/resume")).json()

    def delete_job(self, job_id: str) -> None:
        """A finished job with its metrics, samples, events and checkpoints (409 while it is active)."""
        self._check(self.http.delete(f"/v1/jobs/{job_id}"))

    def usage(self, periods: int = 30) -> dict:
        """Your device time and tokens per budget period, totals, and budget (``GET /v1/usage``)."""
        return self._get("/v1/usage", periods=periods)

    def metrics(self, job_id: str, after_step: int = -1) -> list[dict]:
        """The job's step metrics after ``after_step`` (-1: all, step 0's evaluation before training included)."""
        return self._get(f"/v1/jobs/{job_id}/metrics", after_step=after_step)["data"]

    def metrics_csv(self, job_id: str) -> str:
        return self._check(self.http.get(f"/v1/jobs/{job_id}/metrics", params={"format": "csv"})).text

    def samples(self, job_id: str, step: int | None = None) -> dict:
        return self._get(f"/v1/jobs/{job_id}/samples", step=step)

    def events(self, job_id: str, last_event_id: str | None = None) -> Iterator[tuple[str, dict, str]]:
        """Follow the job's server-sent events: yields ``(event, data, id)`` until ``end``. The server
        ends a stream after a while (GSPO_STREAM_MAX_SECONDS): this resumes from the last id, as a
        browser's EventSource does."""
        while True:
            for event, data, ident in self._event_stream(job_id, last_event_id):
                yield event, data, ident
                if event == "end":
                    return
                last_event_id = ident or last_event_id
            time.sleep(0.5)  # as EventSource's retry: no tight loop if streams keep ending at once

    def _event_stream(self, job_id: str, last_event_id: str | None) -> Iterator[tuple[str, dict, str]]:
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        with self.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=None) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._check(resp)
            event, data, ident = "message", [], ""
            for line in resp.iter_lines():
                if not line:
                    if data:
                        yield event, json.loads("\n".join(data)), ident
                    event, data = "message", []
                elif line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif line.startswith("id:"):
                    ident = line[3:].strip()

    # --- checkpoints ---------------------------------------------------------------------
    def list_checkpoints(self, job_id: str) -> list[dict]:
        return self._get(f"/v1/jobs/{job_id}/checkpoints")["data"]

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        self._check(self.http.delete(f"/v1/checkpoints/{checkpoint_id}"))

    def download_checkpoint(
        self, checkpoint_id: str, dest: str | Path, progress: Callable[[int], None] | None = None
    ) -> Path:
        """Save the .tar.gz to ``dest`` (a file path) and verify it: a readable archive whose files
        add up to the size the server announced."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with self.http.stream(
            "GET", f"/v1/checkpoints/{checkpoint_id}/download", follow_redirects=True, timeout=None
        ) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._check(resp)
            expected = resp.headers.get("X-Checkpoint-Bytes")
            with open(dest, "wb") as f:
                for chunk in resp.iter_bytes(1024 * 1024):
                    f.write(chunk)
                    if progress:
                        progress(len(chunk))
        with tarfile.open(dest, "r:gz") as tar:
            total = sum(m.size for m in tar.getmembers() if m.isfile())
        if expected is not None and int(expected) != total:
            raise ApiError(0, "corrupt_download", f"archive holds {total} bytes of files, server announced {expected}")
        return dest

    # --- rewards -------------------------------------------------------------------------
    def run_reward(
        self, reward: dict, item: dict, samples: list[str] | None = None, messages: list[dict] | None = None
    ) -> dict:
        """Grade ``samples`` (texts), or ``messages`` (one episode's chat transcript, graded as training
        grades it)."""
        body: dict = {"reward": reward, "item": item}
        if messages is not None:
            body["messages"] = messages
        else:
            body["samples"] = list(samples or [])
        return self._check(self.http.post("/v1/rewards/run", json=body)).json()
