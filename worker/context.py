"""Process-wide handles of the worker (database, object store), created on first use."""

from __future__ import annotations

from functools import lru_cache

from store.db import Database
from store.objects import get_object_store
from store.settings import Settings


@lru_cache(maxsize=4)
def _db(url: str) -> Database:
    return Database(url)


def get_db(settings: Settings) -> Database:
    return _db(settings.resolved_database_url())


def get_store(settings: Settings):
    return get_object_store(settings)
