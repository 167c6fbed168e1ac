"""Reward dry runs in a subprocess of their own: niced (the API's requests keep the CPU), killed past a
hard deadline, its memory returned when it exits, and no database, thread or event loop of the API
held while graders run. ``python -m api.services.dry_run`` is the child: a request on stdin, the
result (or an error) as JSON on stdout."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

from api.errors import ApiError

#: Niceness of the child: under load the API's own requests win the CPU.
NICE = 10
#: The child's environment: what graders need (interpreter, locale, model caches, proxies), nothing
#: of the service's own credentials (database, Redis, S3, metrics token).
_ENV_PREFIXES = ("PATH", "HOME", "LANG", "LC_", "TZ", "TMPDIR", "PYTHON", "VIRTUAL_ENV", "HF_", "TRANSFORMERS_",
                 "TOKENIZERS_", "OMP_", "MKL_", "OPENBLAS_", "SSL_CERT", "REQUESTS_CA", "CURL_CA", "NO_PROXY",
                 "HTTP_PROXY", "HTTPS_PROXY", "no_proxy", "http_proxy", "https_proxy")
#: Settings the child never needs (it builds graders; it stores nothing).
_SECRET_SETTINGS = {"database_url", "redis_url", "s3_bucket", "s3_endpoint_url", "s3_access_key_id",
                    "s3_secret_access_key", "s3_public_endpoint_url", "metrics_token"}


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}


async def run_dry(request: dict, settings, timeout_s: float) -> dict:
    """``{"results", "grader_names"}`` of ``request`` (reward, item, samples) graded in a child process;
    ApiError 422 for a bad spec (as the API checks it), 504 past ``timeout_s``."""
    payload = json.dumps({"request": request, "settings": settings.model_dump(mode="json", exclude=_SECRET_SETTINGS)},
                         allow_nan=False).encode()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "api.services.dry_run", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, env=_child_env(), start_new_session=True)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(payload), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(504, "dry_run_timeout", f"the graders ran past {timeout_s:g} s and were stopped; lower "
                       "their timeouts or grade fewer samples", "reward") from None
    finally:
        if proc.returncode is None:  # timed out, or the request was cancelled: stop it and its graders
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await asyncio.shield(proc.wait())
    try:
        answer = json.loads(out)
    except ValueError:
        raise ApiError(500, "dry_run_failed", f"the grading process ended without an answer (exit code "
                       f"{proc.returncode})") from None
    if "error" in answer:
        e = answer["error"]
        raise ApiError(e["status"], e["type"], e["message"], e.get("field"))
    return answer["ok"]


def _grade(request: dict, settings) -> dict:
    from api.services.rewards import build_checked

    fn = build_checked(request["reward"], settings)
    try:
        samples = [{"output_text": t, "output_tokens": len(t), "finish_reason": "stop"} for t in request["samples"]]
        results = fn.score_batch([request["item"]] * len(samples), samples)
    finally:
        fn.close()
    return {"grader_names": fn.grader_names, "results": [
        {"output_text": t, "reward": r.reward, "scores": r.scores, "errors": r.errors}
        for t, r in zip(request["samples"], results)]}


def main() -> int:
    os.nice(NICE)
    answer_to = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed while grading goes to stderr, not into the answer
    try:
        from store.settings import Settings

        job = json.load(sys.stdin)
        answer = {"ok": _grade(job["request"], Settings(**job["settings"]))}
    except ApiError as exc:
        answer = {"error": {"status": exc.status, "type": exc.type, "message": exc.message, "field": exc.field}}
    except Exception as exc:
        answer = {"error": {"status": 500, "type": "dry_run_failed", "message": f"{type(exc).__name__}: {exc}"[:500]}}
    try:
        text = json.dumps(answer, allow_nan=False)
    except ValueError:
        text = json.dumps({"error": {"status": 500, "type": "dry_run_failed", "message": "a score was not finite"}})
    answer_to.write(text)
    answer_to.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
