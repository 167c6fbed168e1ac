"""The session worker (``GSPO_WORKER_MODE=sessions``): leases sessions, runs each one's queued Tinker requests
in order on the models it holds (worker.session_host), writes results and usage, releases idle sessions."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

from store import tinker, tinker_resume
from store.db import Database
from store.model_refs import resolve_model
from store.models import TinkerModel, TinkerRequest
from store.objects import get_object_store
from store.settings import Settings, get_settings
from store.usage import QueuePolicy, budget
from worker.checkpoint_files import Checkpoint, saved_at, stamp
from worker.session_host import Outcome, SavedState, SessionHost, SessionRequestError

log = logging.getLogger(__name__)
IDLE_POLL_SECONDS = 0.05
HOUSEKEEPING_SECONDS = 2.0
#: The most queued ``asample`` requests of one sampler served in one engine call (a cookbook step's group).
SAMPLE_BATCH_CAP = 64
#: Requests on a training model that need it in memory: a model this worker does not hold is restored first.
ON_MODEL = frozenset({"forward", "forward_backward", "optim_step", "save_weights", "load_weights"})


def run_request(host: SessionHost, db: Database, request: TinkerRequest) -> Outcome:
    """One request through the host's primitives; checkpoints are recorded as they are written."""
    payload, model_id = request.payload, request.model_id or ""
    if request.kind in ON_MODEL and not host.holds(model_id):
        restore(host, db, request)
    if request.kind == "create_model":
        return host.create_model(request.session_id, model_id, payload)
    if request.kind in ("forward", "forward_backward"):
        return host.forward_backward(model_id, payload, backward=request.kind == "forward_backward")
    if request.kind == "optim_step":
        return host.optim_step(model_id, payload)
    if request.kind == "save_weights":
        outcome, saved = host.save(request.tenant_id, model_id, payload)
        with db.session() as s:
            model = s.get(TinkerModel, model_id)
            assert model is not None
            row = tinker.record_checkpoint(
                s, model, saved.kind, saved.name, saved.directory, saved.object_prefix, saved.size
            )
            stamp(saved.directory, saved_at(row.created_at))  # whole and recorded: readers may take it as is
        return outcome
    if request.kind == "load_weights":
        state = saved_state(host, db, request.tenant_id, payload["path"], bool(payload["optimizer"]))
        return host.load(model_id, state)
    if request.kind == "unload":
        return host.unload(model_id)
    if request.kind == "sample":
        return run_samples(host, db, [request])[0]
    raise SessionRequestError(f"unknown request kind {request.kind!r}")


def restore(host: SessionHost, db: Database, request: TinkerRequest) -> None:
    """Rebuild a training model this worker does not hold (the worker that did died or stopped) from its base model
    and its last saved state. SessionRequestError where nothing was saved and it has trained since it was made (its
    weights are lost: every call says so), or where that state lacks calls it had run (this request does not run;
    the next ones do, on the restored state)."""
    with db.read_session() as s:
        model = s.get(TinkerModel, request.model_id)
        assert model is not None
        point = tinker_resume.resume_point(s, model.id)
        made = {"base_model": model.base_model, "lora": model.lora}
    if point.path is None and point.behind:
        raise SessionRequestError(
            f"model {model.id} is lost: the worker holding it stopped or died, and nothing was saved since it was "
            f"made (no save_state or load_state), so its {point.behind} forward_backward/optim_step calls are gone; "
            "make a new training client (create_training_client_from_state loads a checkpoint into one)"
        )
    state = None
    if point.path is not None:
        try:
            state = saved_state(host, db, request.tenant_id, point.path, point.optimizer)
        except SessionRequestError as exc:
            raise SessionRequestError(f"model {model.id}: its last saved state {point.path} is gone") from exc
    host.restore(request.session_id, model.id, made, state)
    log.warning("model %s restored from %s, %d calls behind", model.id, point.path or "its base model", point.behind)
    if point.behind:
        raise SessionRequestError(
            f"model {model.id}: the worker holding it stopped or died, and it went on from its last saved state "
            f"{point.path}, which lacks the last {point.behind} forward_backward/optim_step calls it had run; this "
            "request did not run: send it again (it and the next calls run on that state)"
        )


def local_checkpoint(host: SessionHost, db: Database, tenant_id: str, path: str) -> str:
    """A local directory holding the tenant's checkpoint at ``path`` (a path the API checked): where it was saved,
    or this worker's copy fetched from object storage (worker.checkpoint_files); SessionRequestError where it was
    deleted."""
    gone = SessionRequestError(f"checkpoint {path} is gone (deleted)")
    with db.read_session() as s:
        row = tinker.checkpoint_at(s, tenant_id, path)
        if row is None:
            raise gone
        ckpt = Checkpoint.of(row)
    try:
        return host.files.local_dir(ckpt)
    except FileNotFoundError as exc:
        raise gone from exc


def saved_state(host: SessionHost, db: Database, tenant_id: str, path: str, optimizer: bool) -> SavedState:
    """The training checkpoint at ``path`` to load (``load_weights``, or a restore), from a local directory."""
    return SavedState(path, local_checkpoint(host, db, tenant_id, path), optimizer)


def run_samples(host: SessionHost, db: Database, requests: list[TinkerRequest]) -> list[Outcome]:
    """``asample`` requests of one sampler (queued one after another), served together."""
    base, weights = _sampler_weights(host, db, requests[0])
    first = requests[0]
    log.info("sample batch of %d for sampler %s (session %s)", len(requests), first.model_id, first.session_id)
    return host.sample(requests[0].session_id, base, weights, [request.payload for request in requests])


def _sampler_weights(host: SessionHost, db: Database, request: TinkerRequest) -> tuple[str, str]:
    """A sampler's base model directory, and the directory of its weights: its sampler checkpoint's export (a local
    copy, fetched where this worker lacks one), or the base model."""
    with db.read_session() as s:
        sampler = s.get(TinkerModel, request.model_id)
        assert sampler is not None
        base, path = resolve_model(host.settings.models_dir, sampler.base_model), sampler.model_path
    return base, base if path is None else local_checkpoint(host, db, request.tenant_id, path)


def _over_budget(db: Database, policy: QueuePolicy, request: TinkerRequest) -> bool:
    """A request queued before its tenant's budget ran out fails (the API refuses new ones with a 402)."""
    with db.session() as s:
        b = budget(s, policy, request.tenant_id)
        if b.exhausted:
            error = f"tenant device-hour budget used ({b.used_s / 3600:.3g} of {b.budget_s / 3600:.3g} h this period)"
            tinker.finish(s, request.id, None, f"{error} until {b.period_end.isoformat()}", "user")
        return b.exhausted


def _execute(host: SessionHost, db: Database, policy: QueuePolicy, requests: list[TinkerRequest], name: str) -> None:
    """Run one request, or a batch of one sampler's ``asample`` requests (one engine call; each its own result,
    and its share of the wall time as usage). A batch a request's fault fails is run again one by one, so
    only that request fails."""
    requests = [request for request in requests if not _over_budget(db, policy, request)]
    if not requests:
        return
    started = time.monotonic()
    try:
        outcomes = run_samples(host, db, requests) if len(requests) > 1 else [run_request(host, db, requests[0])]
    except (SessionRequestError, ValueError, KeyError) as exc:
        if len(requests) > 1:
            for request in requests:
                _execute(host, db, policy, [request], name)
            return
        log.info("request %s (%s) refused: %s", requests[0].id, requests[0].kind, exc)
        _fail(db, requests, f"{type(exc).__name__}: {exc}", "user")
        return
    except Exception as exc:  # a fault of ours: the requests fail, the worker serves on
        log.exception("request %s (%s) failed", requests[0].id, requests[0].kind)
        _fail(db, requests, f"{type(exc).__name__}: {exc}", "server")
        return
    share = (time.monotonic() - started) / len(requests)
    with db.session() as s:
        for request, outcome in zip(requests, outcomes, strict=True):
            tinker.add_usage(s, policy, request, name, share, outcome.sampled, outcome.trained)
            tinker.finish(s, request.id, outcome.result)


def _fail(db: Database, requests: list[TinkerRequest], error: str, category: str) -> None:
    with db.session() as s:
        for request in requests:
            tinker.finish(s, request.id, None, error, category)


def _claim(host: SessionHost, db: Database, settings: Settings, policy: QueuePolicy, name: str) -> list[TinkerRequest]:
    """The next request in the fair order, with the same sampler's ``asample`` requests queued right after it; a
    session taken afresh has any models this worker kept of it dropped (another worker may have held it since)."""
    taken: list[str] = []
    with db.session() as s:
        request = tinker.claim_next(s, name, settings.lease_seconds, policy, taken=taken.append)
        batch = [] if request is None else [request]
        if request is not None and request.kind == "sample":
            batch += tinker.claim_following(s, request, SAMPLE_BATCH_CAP - 1)
        for row in batch:
            s.expunge(row)
    for session_id in taken:  # out of the claim's transaction: closing an engine takes a while
        host.release(session_id)
    return batch


def _housekeeping(host: SessionHost, db: Database, settings: Settings, name: str) -> None:
    """Free the sessions of dead workers, close idle sessions, drop the models of sessions this worker no longer
    holds (closed, or reaped while it stalled)."""
    with db.session() as s:
        lost = tinker_resume.reap_lost(s)
        tinker.close_idle(s, settings.session_idle_seconds)
        gone = tinker_resume.not_held(s, name, sorted(host.sessions()))
    if lost:
        log.warning("sessions %s lost their worker: their unfinished requests failed", lost)
    for session_id in gone:
        log.info("releasing the models of session %s", session_id)
        host.release(session_id)


def _renew_leases(db: Database, settings: Settings, name: str, stop: threading.Event) -> threading.Thread:
    """Renew this worker's leases every third of their length, also while a long request runs: only a worker
    that died (or stalled that long) loses its sessions."""

    def loop() -> None:
        while not stop.wait(settings.lease_seconds / 3):
            try:
                with db.session() as s:
                    tinker.renew_lease(s, name, settings.lease_seconds)
            except Exception:  # the database away for a moment: the next beat tries again
                log.warning("renewing the session leases of %s failed", name, exc_info=True)

    thread = threading.Thread(target=loop, name="session-leases", daemon=True)
    thread.start()
    return thread


def serve(settings: Settings, stop: threading.Event, name: str | None = None) -> None:
    """Run sessions' requests until ``stop`` is set."""
    name = name or f"sessions@{socket.gethostname()}:{os.getpid()}"
    db = Database(settings.resolved_database_url())
    host = SessionHost(settings, get_object_store(settings))
    policy = QueuePolicy.of(settings)
    last_housekeeping = 0.0
    leases = threading.Event()
    renewer = _renew_leases(db, settings, name, leases)
    try:
        while not stop.is_set():
            if time.monotonic() - last_housekeeping > HOUSEKEEPING_SECONDS:
                _housekeeping(host, db, settings, name)
                last_housekeeping = time.monotonic()
            batch = _claim(host, db, settings, policy, name)
            if not batch:
                stop.wait(IDLE_POLL_SECONDS)
                continue
            _execute(host, db, policy, batch, name)
    finally:
        leases.set()
        renewer.join()
        for session_id in sorted(host.sessions()):
            host.release(session_id)
        with db.session() as s:  # hand the sessions back at once (a killed worker's leases run out instead)
            tinker_resume.hand_back(s, name)
        db.dispose()


def main() -> None:
    logging.basicConfig(level=os.environ.get("GSPO_LOG_LEVEL", "WARNING").upper())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve(get_settings(), stop)


if __name__ == "__main__":
    main()
