"""Service commands: `gspo up` (embedded: API + worker + dashboard), `api`, `worker`, `migrate`,
`admin create-key|revoke-key`, and `demo` (the README's first command)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading

log = logging.getLogger("gspo.up")


def _settings():
    from store.settings import get_settings

    return get_settings()


def migrate(_args=None) -> int:
    from store.db import run_migrations
    from store.private import private_dir

    s = _settings()
    private_dir(s.data_dir)
    run_migrations(s.resolved_database_url())
    return 0


def create_key(tenant: str) -> str:
    from store.db import Database
    from store.tenants import create_tenant_and_key

    db = Database(_settings().resolved_database_url())
    try:
        with db.session() as s:
            _, key = create_tenant_and_key(s, tenant)
    finally:
        db.dispose()
    return key


def worker_command(loglevel: str = "INFO", name: str | None = None, queue: str | None = None) -> list[str]:
    """Prefork, one job at a time, a fresh child process per job (its exit frees GPU memory); on
    SIGTERM the running job checkpoints and is requeued (worker.celery_app)."""
    quiet = ["--quiet"] if loglevel.upper() in ("WARNING", "ERROR") else []
    return [
        sys.executable,
        "-m",
        "celery",
        *quiet,
        "-A",
        "worker.celery_app",
        "worker",
        "--pool",
        "prefork",
        "--concurrency",
        "1",
        "--max-tasks-per-child",
        "1",
        "-Q",
        queue or _settings().worker_queue,
        "--without-gossip",
        "--without-mingle",
        "-n",
        name or f"gspo-{os.getpid()}@%h",
        "--loglevel",
        loglevel,
    ]


def start_worker(
    loglevel: str = "WARNING", rollout_engine: str | None = None, name: str | None = None
) -> subprocess.Popen:
    """The embedded worker in its own process group, so a forced stop reaches its pool child too;
    ``rollout_engine`` (the operator's setting, `Settings.rollout_engine`) overrides GSPO_ROLLOUT_ENGINE for it."""
    env = {**os.environ, **({"GSPO_ROLLOUT_ENGINE": rollout_engine} if rollout_engine else {})}
    cmd = worker_command(loglevel, name=name)
    quiet = logging.getLevelName(loglevel.upper()) > logging.INFO
    if quiet:
        # Celery warns of any worker run as root. Its danger, a pickled message running code as root, is one
        # Celery refuses itself here (the worker accepts JSON only), and the embedded worker runs as whoever
        # started `gspo up` on their machine: theirs to choose, so the warning shows at --verbose only.
        cmd[1:1] = ["-W", "ignore:You're running the worker with superuser privileges"]
    # Celery prints its "worker: Warm shutdown (MainProcess)" to stdout whatever the log level; its logs
    # (ours among them) go to stderr, so a quiet start keeps stdout for the service's own lines.
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL if quiet else None)


def session_worker_command() -> list[str]:
    """The Tinker API's session worker (worker.sessions): it holds sessions' models and runs their requests."""
    return [sys.executable, "-m", "worker.sessions"]


def start_session_worker(rollout_engine: str | None = None) -> subprocess.Popen:
    """`gspo up`'s session worker, beside its job worker, so the embedded service serves the Tinker API too."""
    env = {**os.environ, **({"GSPO_ROLLOUT_ENGINE": rollout_engine} if rollout_engine else {})}
    return subprocess.Popen(session_worker_command(), env=env, start_new_session=True)


def stop_worker(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM (the running job checkpoints and is requeued); SIGKILL the group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class SupervisedWorker:
    """`gspo up`'s worker, restarted when it dies: its process group is killed (a pool child left running a
    job would hold the job's lease), its beat cleared at once (/readyz reports it missing until the new
    one is ready), and a new one started after a back-off that doubles while restarts keep failing."""

    POLL_S = 0.5

    def __init__(self, loglevel: str, rollout_engine: str | None) -> None:
        self.loglevel, self.rollout_engine = loglevel, rollout_engine
        self.name = f"gspo-{os.getpid()}@{socket.gethostname()}"
        self.restarts = 0
        self._stop = threading.Event()
        self.proc = start_worker(loglevel, rollout_engine, self.name)
        self._thread = threading.Thread(target=self._watch, name="gspo-worker-supervisor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        from store import workers

        delay = 1.0
        while not self._stop.wait(self.POLL_S):
            code = self.proc.poll()
            if code is None:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            try:
                workers.forget(_settings(), self.name)
            except Exception as exc:  # Redis down: the beat runs out instead
                log.warning("could not clear the dead worker's beat: %s", exc)
            log.warning("the worker exited (code %s): restarting it in %.0f s", code, delay)
            if self._stop.wait(delay):
                return
            self.proc = start_worker(self.loglevel, self.rollout_engine, self.name)
            self.restarts += 1
            delay = min(delay * 2, 60.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        stop_worker(self.proc)


def sandbox_line() -> str:
    """Which isolation python graders get on this host, and why (the line `gspo up` prints at start)."""
    from gspo_core.rewards import GraderPolicy
    from gspo_core.rewards.isolation import BUBBLEWRAP, isolation_for

    iso = isolation_for(GraderPolicy.from_mapping(_settings().grader_policy()))
    if iso.mode == BUBBLEWRAP:
        env = os.path.dirname(os.path.dirname(iso.python))
        return f"python graders: bubblewrap isolation (grader environment {env})"
    return f"python graders: {iso.mode} ({iso.reason})"


def up_key(tenant: str) -> str:
    """The key `gspo up` prints for ``tenant``: the one an earlier `gspo up` on this data directory minted,
    while it is not revoked, else a new one, kept in the (private) data directory for the next start."""
    from store.db import Database
    from store.private import open_private, private_dir
    from store.tenants import authenticate

    path = private_dir(_settings().data_dir) / f"up-key-{re.sub(r'[^A-Za-z0-9_.-]', '_', tenant)}"
    if path.exists():
        key = path.read_text().strip()
        db = Database(_settings().resolved_database_url())
        try:
            with db.session() as s:
                owner = authenticate(s, key)
                if owner is not None and owner.name == tenant:
                    return key
        finally:
            db.dispose()
    key = create_key(tenant)
    with open_private(path) as fh:
        fh.write(key.encode())
    return key


def run_api(host: str, port: int, workers: int = 1, log_level: str = "warning") -> None:
    import uvicorn

    if workers == 1:
        from api.app import create_app

        uvicorn.run(create_app(_settings()), host=host, port=port, log_level=log_level)
        return
    # Each worker process builds its own app (engine pool, object store) from the same Settings, and
    # counts its Prometheus metrics into one shared directory that a scrape of any of them sums.
    import shutil
    import tempfile

    own_dir = None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        own_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="gspo-prometheus-")
    try:
        uvicorn.run("api.app:create_app", factory=True, host=host, port=port, workers=workers, log_level=log_level)
    finally:
        if own_dir:
            shutil.rmtree(own_dir, ignore_errors=True)


def up(args) -> int:
    from gspo_cli import logs

    level = logs.level_of(args.verbose)
    logs.configure(level)
    migrate()
    key = up_key(args.tenant)
    worker = SupervisedWorker(logging.getLevelName(level), args.rollout_engine)
    sessions = start_session_worker(args.rollout_engine)
    print(f"GSPO service on http://{args.host}:{args.port}  (dashboard: /, API docs: /docs)")
    print(f"API key for tenant {args.tenant!r}: {key}")
    print(f"data directory: {_settings().data_dir.resolve()}")
    print(sandbox_line(), flush=True)
    # uvicorn re-raises SIGTERM after its shutdown; turn it into SystemExit so the worker is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        run_api(args.host, args.port, log_level=logs.uvicorn_level(level))
    finally:
        stop_worker(sessions)
        worker.stop()
    return 0


def api_cmd(args) -> int:
    run_api(args.host, args.port, args.workers)
    return 0


def worker_cmd(args) -> int:
    """A job worker (Celery) or, with GSPO_WORKER_MODE=sessions, a session worker: the operator's choice."""
    cmd = session_worker_command() if _settings().worker_mode == "sessions" else worker_command(args.loglevel)
    os.execv(cmd[0], cmd)  # become the worker, so SIGTERM from an orchestrator reaches Celery itself


def admin_create_key(args) -> int:
    print(create_key(args.tenant))
    return 0


def admin_revoke_key(args) -> int:
    from store.db import Database
    from store.tenants import revoke_key

    db = Database(_settings().resolved_database_url())
    with db.session() as s:
        ok = revoke_key(s, args.key)
    print("revoked" if ok else "no such key")
    return 0 if ok else 1


def demo(args) -> int:
    if args.steps is None:
        args.steps = 12 if args.real else 60
    if args.real:
        from gspo_cli.demo_real import run_real_demo

        return run_real_demo(args)
    from gspo_cli.demo import run_demo

    return run_demo(args)


VERBOSE_HELP = "show every library's logs too (vLLM, Celery, uvicorn...): GSPO_LOG_LEVEL=INFO"


def register(sub) -> None:
    p = sub.add_parser("up", help="run API + worker + dashboard on this machine (embedded default)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tenant", default="default")
    p.add_argument(
        "--rollout-engine",
        choices=["auto", "vllm", "transformers"],
        help="the worker's rollout engine (default: GSPO_ROLLOUT_ENGINE, else auto)",
    )
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=up)
    p = sub.add_parser("api", help="run the API server only")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="server processes (one core each: Python serves a request on one core at a time)",
    )
    p.set_defaults(func=api_cmd)
    p = sub.add_parser("worker", help="run a GPU worker (Celery, one job at a time)")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=worker_cmd)
    p = sub.add_parser("migrate", help="apply database migrations")
    p.set_defaults(func=migrate)
    admin = sub.add_parser("admin", help="administration").add_subparsers(dest="admin_command", required=True)
    p = admin.add_parser("create-key", help="create an API key for a tenant (created if new)")
    p.add_argument("--tenant", required=True)
    p.set_defaults(func=admin_create_key)
    p = admin.add_parser("revoke-key", help="revoke an API key (by id or the key itself)")
    p.add_argument("key")
    p.set_defaults(func=admin_revoke_key)
    p = sub.add_parser("demo", help="start the embedded service, train a tiny model, download its checkpoint")
    p.add_argument("--port", type=int, default=0, help="0 = any free port")
    p.add_argument("--steps", type=int, default=None, help="default: 60 (toy), 12 (--real)")
    p.add_argument("--engine", default="auto", choices=["auto", "vllm", "transformers"])
    p.add_argument(
        "--real",
        action="store_true",
        help="a real model instead: SmolLM2-135M-Instruct (imported once) on a reasoning-gym task, held-out "
        "accuracy before -> after",
    )
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=demo)
