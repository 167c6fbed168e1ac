"""Which workers are alive: each worker's main process renews a beat (a Redis key with a TTL, or a file
under the embedded broker's folder), so /readyz can report a missing worker and `gspo up` can clear a dead one's."""

from __future__ import annotations

import re
import time
from pathlib import Path

from store.private import private_dir
from store.settings import Settings

_PREFIX = "gspo:worker:"


def _folder(settings: Settings) -> Path:
    return private_dir((settings.data_dir / "broker" / "workers").resolve())


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@-]", "_", name)


def _redis(settings: Settings):
    import redis

    return redis.Redis.from_url(str(settings.redis_url), socket_timeout=2, socket_connect_timeout=2)


def ttl_seconds(settings: Settings) -> float:
    """How long a beat counts: three missed beats and the worker is missing."""
    return 3 * settings.heartbeat_seconds


def beat(settings: Settings, name: str) -> None:
    """Worker ``name`` is alive now."""
    if settings.redis_url:
        _redis(settings).set(_PREFIX + name, str(time.time()), ex=max(1, round(ttl_seconds(settings))))
        return
    path = _folder(settings) / _file_name(name)
    path.touch()


def forget(settings: Settings, name: str) -> None:
    """Worker ``name`` stopped (its own clean stop, or its supervisor saw it die)."""
    if settings.redis_url:
        _redis(settings).delete(_PREFIX + name)
        return
    (_folder(settings) / _file_name(name)).unlink(missing_ok=True)


def alive(settings: Settings) -> list[str]:
    """Names of the workers whose last beat is recent."""
    if settings.redis_url:
        return sorted(k.decode()[len(_PREFIX) :] for k in _redis(settings).scan_iter(_PREFIX + "*"))
    cutoff = time.time() - ttl_seconds(settings)
    out = []
    for path in _folder(settings).iterdir():
        try:
            if path.stat().st_mtime >= cutoff:
                out.append(path.name)
        except FileNotFoundError:
            continue
    return sorted(out)
