"""API keys: random, shown once, stored only as sha256, revoked keys stop working at once."""

from __future__ import annotations

import hashlib

from sqlalchemy import select, text

from store.models import ApiKey
from store.tenants import authenticate, create_key, create_tenant_and_key, revoke_key


def test_keys_are_stored_hashed_and_authenticate(db):
    with db.session() as s:
        tenant, key = create_tenant_and_key(s, "acme")
    with db.session() as s:
        dump = " ".join(str(v) for row in s.execute(text("SELECT * FROM api_keys")) for v in row)
        assert key not in dump and key[12:] not in dump, "the plaintext key is never stored"
        row = s.scalar(select(ApiKey))
        assert row.key_hash == hashlib.sha256(key.encode()).hexdigest() and key.startswith(row.prefix)
        assert authenticate(s, key).id == tenant.id
        assert authenticate(s, key + "x") is None and authenticate(s, "") is None


def test_same_tenant_gets_a_second_key(db):
    with db.session() as s:
        t1, k1 = create_tenant_and_key(s, "acme")
        t2, k2 = create_tenant_and_key(s, "acme")
        assert t1.id == t2.id and k1 != k2


def test_revoked_key_stops_working_at_once_other_keys_keep_working(db):
    with db.session() as s:
        tenant, key = create_tenant_and_key(s, "acme")
        second, key2 = create_key(s, tenant)
        other = s.scalar(select(ApiKey).where(ApiKey.id != second.id))
    with db.session() as s:
        assert revoke_key(s, other.id)
    with db.session() as s:
        assert authenticate(s, key) is None
        assert authenticate(s, key2).id == tenant.id
        assert revoke_key(s, key2) and not revoke_key(s, "key_nope")
    with db.session() as s:
        assert authenticate(s, key2) is None
