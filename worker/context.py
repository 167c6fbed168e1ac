"""Process-wide handles of the worker (database, object store), created on first use."""

from __future__ import annotations

import threading

from store.db import Database
from store.objects import ObjectStore, get_object_store
from store.settings import Settings

_DBS: dict[str, Database] = {}
# Set in the job process on the worker's warm shutdown (SIGTERM): the job checkpoints and is requeued.
SHUTDOWN = threading.Event()


def get_db(settings: Settings) -> Database:
    url = settings.resolved_database_url()
    if url not in _DBS:
        _DBS[url] = Database(url)
    return _DBS[url]


def get_store(settings: Settings) -> ObjectStore:
    return get_object_store(settings)


def reset_after_fork() -> None:
    """In a freshly forked pool child: forget the parent's pooled connections without closing them
    (closing would send PostgreSQL a Terminate on the parent's socket and break the parent's reaper)."""
    for db in _DBS.values():
        db.engine.dispose(close=False)
    _DBS.clear()
