"""The session worker (``GSPO_WORKER_MODE=sessions``): leases sessions, runs each one's queued Tinker requests
in order on the models it holds (worker.session_host), writes results and usage, releases idle sessions."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

from store import tinker
from store.db import Database
from store.model_refs import resolve_model
from store.models import TinkerModel, TinkerRequest, TinkerSession
from store.objects import get_object_store
from store.settings import Settings, get_settings
from store.usage import QueuePolicy, budget
from worker.session_host import Outcome, SessionHost, SessionRequestError

log = logging.getLogger(__name__)
IDLE_POLL_SECONDS = 0.05
HOUSEKEEPING_SECONDS = 2.0


def run_request(host: SessionHost, db: Database, request: TinkerRequest) -> Outcome:
    """One request through the host's primitives; checkpoints are recorded as they are written."""
    payload, model_id = request.payload, request.model_id or ""
    if request.kind == "create_model":
        return host.create_model(request.session_id, model_id, payload)
    if request.kind in ("forward", "forward_backward"):
        return host.forward_backward(model_id, payload, backward=request.kind == "forward_backward")
    if request.kind == "optim_step":
        return host.optim_step(model_id, payload)
    if request.kind == "save_weights":
        outcome, saved = host.save(model_id, payload)
        with db.session() as s:
            model = s.get(TinkerModel, model_id)
            assert model is not None
            tinker.record_checkpoint(s, model, saved.kind, saved.name, saved.directory, saved.object_prefix, saved.size)
        return outcome
    if request.kind == "load_weights":
        return host.load(model_id, payload)
    if request.kind == "unload":
        return host.unload(model_id)
    if request.kind == "sample":
        return host.sample(request.session_id, model_id, _sampler_weights(host, db, request), payload)
    raise SessionRequestError(f"unknown request kind {request.kind!r}")


def _sampler_weights(host: SessionHost, db: Database, request: TinkerRequest) -> str:
    """The directory a sampler loads: its sampler checkpoint's export, or the base model."""
    with db.read_session() as s:
        sampler = s.get(TinkerModel, request.model_id)
        assert sampler is not None
        if sampler.model_path is None:
            return resolve_model(host.settings.models_dir, sampler.base_model)
        run_id, _, name = sampler.model_path.removeprefix("tinker://").split("/")
        ckpt = tinker.find_checkpoint(s, request.tenant_id, run_id, "sampler", name)
        if ckpt is None:
            raise SessionRequestError(f"no sampler weights at {sampler.model_path}")
        return ckpt.directory


def _over_budget(db: Database, policy: QueuePolicy, request: TinkerRequest) -> bool:
    """A request queued before its tenant's budget ran out fails (the API refuses new ones with a 402)."""
    with db.session() as s:
        b = budget(s, policy, request.tenant_id)
        if b.exhausted:
            error = f"tenant device-hour budget used ({b.used_s / 3600:.3g} of {b.budget_s / 3600:.3g} h this period)"
            tinker.finish(s, request.id, None, f"{error} until {b.period_end.isoformat()}", "user")
        return b.exhausted


def _execute(host: SessionHost, db: Database, policy: QueuePolicy, request: TinkerRequest, name: str) -> None:
    if _over_budget(db, policy, request):
        return
    started = time.monotonic()
    try:
        outcome = run_request(host, db, request)
    except (SessionRequestError, ValueError, KeyError) as exc:
        log.info("request %s (%s) refused: %s", request.id, request.kind, exc)
        with db.session() as s:
            tinker.finish(s, request.id, None, f"{type(exc).__name__}: {exc}", "user")
        return
    except Exception as exc:  # a fault of ours: the request fails, the worker serves on
        log.exception("request %s (%s) failed", request.id, request.kind)
        with db.session() as s:
            tinker.finish(s, request.id, None, f"{type(exc).__name__}: {exc}", "server")
        return
    with db.session() as s:
        tinker.add_usage(s, policy, request, name, time.monotonic() - started, outcome.sampled, outcome.trained)
        tinker.finish(s, request.id, outcome.result)


def _housekeeping(host: SessionHost, db: Database, settings: Settings, name: str) -> None:
    """Renew this worker's leases, close its idle sessions, free the models of sessions no longer active."""
    with db.session() as s:
        tinker.renew_lease(s, name, settings.lease_seconds)
        tinker.reap_lost(s)
        tinker.close_idle(s, settings.session_idle_seconds)
        gone = tinker.closed_sessions(s, sorted(host.sessions()))
    for session_id in gone:
        log.info("releasing the models of session %s", session_id)
        host.release(session_id)


def serve(settings: Settings, stop: threading.Event, name: str | None = None) -> None:
    """Run sessions' requests until ``stop`` is set."""
    name = name or f"sessions@{socket.gethostname()}:{os.getpid()}"
    db = Database(settings.resolved_database_url())
    host = SessionHost(settings, get_object_store(settings))
    policy = QueuePolicy.of(settings)
    last_housekeeping = 0.0
    try:
        while not stop.is_set():
            if time.monotonic() - last_housekeeping > HOUSEKEEPING_SECONDS:
                _housekeeping(host, db, settings, name)
                last_housekeeping = time.monotonic()
            with db.session() as s:
                request = tinker.claim_next(s, name, settings.lease_seconds, policy)
                if request is not None:
                    s.expunge(request)
            if request is None:
                stop.wait(IDLE_POLL_SECONDS)
                continue
            _execute(host, db, policy, request, name)
    finally:
        for session_id in sorted(host.sessions()):
            host.release(session_id)
        with db.session() as s:  # hand the sessions back at once (a killed worker's leases run out instead)
            s.query(TinkerSession).filter(TinkerSession.lease_owner == name).update({"lease_owner": None})
            s.commit()
        db.dispose()


def main() -> None:
    logging.basicConfig(level=os.environ.get("GSPO_LOG_LEVEL", "WARNING").upper())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve(get_settings(), stop)


if __name__ == "__main__":
    main()
