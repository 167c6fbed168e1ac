"""Database engine, sessions and programmatic Alembic migrations."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from store.private import private_dir, private_file

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
SQLITE_BUSY_MS = 30_000


def make_engine(url: str) -> Engine:
    """An engine; SQLite gets WAL + a busy timeout so the API and the worker can share it, a file only this
    user reads (SQLite gives its -wal and -shm files the database file's permissions), and deleted content
    overwritten with zeros (``secure_delete``: not every build has it on by default)."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:" and not path.startswith("file:"):
            private_dir(Path(path).parent)
            private_file(path)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _pragmas(conn, _record):
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_MS}")
            cur.execute("PRAGMA secure_delete=ON")
            cur.close()

        return engine
    # More connections than the API's 40 worker threads: a request whose dependency cleanup waits for a
    # thread while every thread waits for a connection would otherwise deadlock the pool.
    return create_engine(url, pool_pre_ping=True, pool_size=20, max_overflow=40, pool_timeout=10, pool_recycle=1800)


def checkpoint_wal(engine: Engine, busy_ms: int = 2000) -> bool:
    """After a deletion on SQLite: copy the WAL into the database and truncate it to nothing, so deleted rows
    do not stay on disk in the -wal file's older frames. True when done; a reader holding an older snapshot
    for more than ``busy_ms`` leaves it to the next deletion's checkpoint (a request must not wait on a
    reader). Nothing to do on other databases."""
    if engine.dialect.name != "sqlite":
        return True
    with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        conn.exec_driver_sql(f"PRAGMA busy_timeout={int(busy_ms)}")
        try:
            busy = conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").one()[0]
        finally:
            conn.exec_driver_sql(f"PRAGMA busy_timeout={SQLITE_BUSY_MS}")
    return not busy


class Database:
    """An engine plus a session factory; ``with db.session() as s:`` commits or rolls back."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self._factory = sessionmaker(self.engine, expire_on_commit=False)
        # Same pool; each statement commits by itself, so a read costs no BEGIN/COMMIT round trips.
        self._read_factory = sessionmaker(
            self.engine.execution_options(isolation_level="AUTOCOMMIT"), expire_on_commit=False, autoflush=False
        )

    @contextmanager
    def session(self) -> Iterator[Session]:
        s = self._factory()
        try:
            yield s
            s.commit()
        except BaseException:
            s.rollback()
            raise
        finally:
            s.close()

    def new_session(self) -> Session:
        """An unmanaged session in a transaction (caller commits and closes); prefer :meth:`session`."""
        return self._factory()

    def read_session(self) -> Session:
        """A session for reads only (caller closes it). Its statements autocommit: what it sees is
        each statement's own snapshot, and closing it sends nothing to the server, so it may be
        closed on an event loop."""
        return self._read_factory()

    def checkpoint_wal(self) -> bool:
        return checkpoint_wal(self.engine)

    def dispose(self) -> None:
        self.engine.dispose()


def alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def run_migrations(url: str) -> None:
    """``alembic upgrade head`` on ``url`` (the only way the schema changes)."""
    from alembic import command

    if url.startswith("sqlite"):
        make_engine(url).dispose()  # creates the parent directory
    command.upgrade(alembic_config(url), "head")
