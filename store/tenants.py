"""Tenants and API keys: keys are random, shown once, stored as sha256 hashes, revocable; a tenant's stored bytes."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from store.models import ApiKey, Checkpoint, File, Tenant, utcnow

KEY_PREFIX = "gspo_"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class StorageQuotaExceeded(RuntimeError):
    """A checkpoint would take the tenant's files and checkpoints past its storage quota."""

    def __init__(self, used: int, limit: int) -> None:
        self.used, self.limit = used, limit
        super().__init__(
            f"storage quota exceeded: this checkpoint would bring your files and checkpoints to {used} of the "
            f"{limit} bytes allowed; delete files, checkpoints or finished jobs to make room"
        )


def stored_bytes(s: Session, tenant_id: str) -> int:
    """What the tenant's storage quota counts: its uploaded files and its jobs' checkpoints, in bytes."""
    files = s.scalar(select(func.coalesce(func.sum(File.bytes), 0)).where(File.tenant_id == tenant_id))
    ckpts = s.scalar(select(func.coalesce(func.sum(Checkpoint.size_bytes), 0)).where(Checkpoint.tenant_id == tenant_id))
    return int(files or 0) + int(ckpts or 0)


def get_or_create_tenant(s: Session, name: str) -> Tenant:
    tenant = s.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        tenant = Tenant(name=name)
        s.add(tenant)
        s.flush()
    return tenant


def create_key(s: Session, tenant: Tenant) -> tuple[ApiKey, str]:
    """A new key for ``tenant``; the plaintext is returned once and never stored."""
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(tenant_id=tenant.id, prefix=plaintext[:12], key_hash=hash_key(plaintext))
    s.add(key)
    s.flush()
    return key, plaintext


def create_tenant_and_key(s: Session, name: str) -> tuple[Tenant, str]:
    tenant = get_or_create_tenant(s, name)
    _, plaintext = create_key(s, tenant)
    return tenant, plaintext


def _live_key(plaintext: str) -> tuple:
    """WHERE clauses on ``ApiKey``: this key, not revoked."""
    return ApiKey.key_hash == hash_key(plaintext), ApiKey.revoked_at.is_(None)


def authenticate(s: Session, plaintext: str) -> Tenant | None:
    """The tenant of a valid, unrevoked key, else None."""
    if not plaintext:
        return None
    # One query: it runs on every request.
    return s.scalar(select(Tenant).join(ApiKey, ApiKey.tenant_id == Tenant.id).where(*_live_key(plaintext)))


def owned_by_key(s: Session, model, row_id: str, plaintext: str):
    """``model``'s row ``row_id`` if it belongs to the tenant of a valid, unrevoked key, else None."""
    if not plaintext:
        return None
    return s.scalar(
        select(model).join(ApiKey, ApiKey.tenant_id == model.tenant_id).where(model.id == row_id, *_live_key(plaintext))
    )


def revoke_key(s: Session, key_id_or_plaintext: str) -> bool:
    """Revoke by key id or by the key itself; effective on the next request."""
    key = s.get(ApiKey, key_id_or_plaintext) or s.scalar(
        select(ApiKey).where(ApiKey.key_hash == hash_key(key_id_or_plaintext))
    )
    if key is None:
        return False
    key.revoked_at = utcnow()
    return True
