"""Per-tenant bounds: concurrency slots and a windowed time budget, shared by every API process.

With ``REDIS_URL`` the counts live in Redis, so a cap holds across ``gspo api --workers N`` and across
hosts; without it (the embedded default, one process) they live in the process. Caps on this
process's own resources (its grading subprocesses, streams, upload validations) are always local.
A slot in Redis is a lease that its process renews while it holds it: a process that dies frees its
slots within ``LEASE_S``. While Redis is unreachable the shared counts fall back to the process's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import anyio

from api.errors import ApiError

log = logging.getLogger(__name__)

#: What a 429 of a concurrency cap tells the client to wait (a slot frees when a call ends).
RETRY_SLOT_S = 5
LEASE_S = 60.0

_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[2]))
return 1
"""
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[1]))
return 1
"""


class LocalCounters:
    """Slots and budgets of this process (the event loop is its only user: no lock needed)."""

    def __init__(self) -> None:
        self.held: dict[str, set[str]] = defaultdict(set)
        self.spent: dict[tuple[str, int], float] = {}

    async def acquire(self, key: str, cap: int) -> str | None:
        if len(self.held[key]) >= cap:
            return None
        token = uuid.uuid4().hex
        self.held[key].add(token)
        return token

    async def release(self, key: str, token: str) -> None:
        self.held[key].discard(token)
        if not self.held[key]:
            del self.held[key]

    async def used(self, key: str, window: int) -> float:
        return self.spent.get((key, window), 0.0)

    async def spend(self, key: str, window: int, seconds: float, _ttl: float) -> None:
        for old in [k for k in self.spent if k[1] < window]:
            del self.spent[old]
        self.spent[(key, window)] = self.spent.get((key, window), 0.0) + seconds


class RedisCounters:
    """The same in Redis: a slot is a member of a sorted set scored by its lease's end (server time)."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis

        self.redis = aioredis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self.acquire_script = self.redis.register_script(_ACQUIRE)
        self.renew_script = self.redis.register_script(_RENEW)
        self.held: dict[str, str] = {}  # token -> key, renewed by one task while held
        self.renewer: asyncio.Task | None = None

    async def acquire(self, key: str, cap: int) -> str | None:
        token = uuid.uuid4().hex
        if not await self.acquire_script(keys=[key], args=[cap, int(LEASE_S * 1000), token]):
            return None
        self.held[token] = key
        if self.renewer is None or self.renewer.done():
            self.renewer = asyncio.get_running_loop().create_task(self._renew())
        return token

    async def release(self, key: str, token: str) -> None:
        self.held.pop(token, None)
        await self.redis.zrem(key, token)

    async def _renew(self) -> None:
        while self.held:
            await asyncio.sleep(LEASE_S / 4)
            for token, key in list(self.held.items()):
                try:
                    await self.renew_script(keys=[key], args=[int(LEASE_S * 1000), token])
                except Exception as exc:  # the lease runs on; the next round tries again
                    log.warning("could not renew a limiter lease: %s", exc)

    async def used(self, key: str, window: int) -> float:
        return float(await self.redis.get(f"{key}:{window}") or 0.0)

    async def spend(self, key: str, window: int, seconds: float, ttl: float) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            # A pipeline's commands are queued (nothing to await) and sent together by execute().
            pipe.incrbyfloat(f"{key}:{window}", seconds)
            pipe.expire(f"{key}:{window}", int(ttl) + 60)
            await pipe.execute()

    async def close(self) -> None:
        if self.renewer is not None:
            self.renewer.cancel()
        await self.redis.aclose()


class Limits:
    """The API's bounds: ``slot()`` for concurrency, ``check_budget()``/``charge()`` for time. While
    Redis cannot be reached the shared counts fall back to this process's (bounded, per process)."""

    def __init__(self, redis_url: str | None) -> None:
        self.process = LocalCounters()
        self.shared: LocalCounters | RedisCounters = RedisCounters(redis_url) if redis_url else self.process

    async def _counters(self, call: str, *args: Any) -> tuple[LocalCounters | RedisCounters, Any]:
        """``(counters that answered, answer)``: the shared ones, or this process's when Redis fails."""
        try:
            return self.shared, await getattr(self.shared, call)(*args)
        except Exception as exc:
            if self.shared is self.process:
                raise
            log.warning("limiter: Redis unreachable (%s); counting in this process", type(exc).__name__)
            return self.process, await getattr(self.process, call)(*args)

    @contextlib.asynccontextmanager
    async def slot(self, what: str, tenant_id: str, per_tenant: int, per_process: int) -> AsyncIterator[None]:
        """Hold one of the tenant's ``per_tenant`` slots of ``what`` and one of this process's
        ``per_process``: 429 (tenant) or 503 (process) with Retry-After when none is free."""
        local_key, shared_key = f"process:{what}", f"gspo:limits:slots:{what}:{tenant_id}"
        local = await self.process.acquire(local_key, per_process)
        if local is None:
            raise ApiError(
                503,
                "server_busy",
                f"this server runs {per_process} {what} at once; retry shortly",
                headers={"Retry-After": str(RETRY_SLOT_S)},
            )
        try:
            counters, token = await self._counters("acquire", shared_key, per_tenant)
            if token is None:
                raise ApiError(
                    429,
                    "too_many_requests",
                    f"at most {per_tenant} concurrent {what} per tenant; retry when one has finished",
                    headers={"Retry-After": str(RETRY_SLOT_S)},
                )
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True):  # a cancelled stream still gives its slot back
                    try:
                        await counters.release(shared_key, token)
                    except Exception as exc:  # its lease expires instead
                        log.warning("could not release a %s slot: %s", what, exc)
        finally:
            await self.process.release(local_key, local)

    @staticmethod
    def _window(window_s: float) -> tuple[int, float]:
        now = time.time()
        return int(now // window_s), window_s - now % window_s

    async def check_budget(self, what: str, tenant_id: str, budget_s: float, window_s: float) -> None:
        """429 with Retry-After (the window's end) once the tenant used ``budget_s`` in this window."""
        window, left = self._window(window_s)
        _, used = await self._counters("used", f"gspo:limits:budget:{what}:{tenant_id}", window)
        if used >= budget_s:
            raise ApiError(
                429,
                "budget_exhausted",
                f"{what} used {used:.0f} of the {budget_s:g} s allowed per {window_s:g} s; retry after the window ends",
                headers={"Retry-After": str(int(left) + 1)},
            )

    async def charge(self, what: str, tenant_id: str, seconds: float, window_s: float) -> None:
        window, _ = self._window(window_s)
        with anyio.CancelScope(shield=True):
            await self._counters("spend", f"gspo:limits:budget:{what}:{tenant_id}", window, seconds, window_s)

    async def close(self) -> None:
        if isinstance(self.shared, RedisCounters):
            await self.shared.close()
