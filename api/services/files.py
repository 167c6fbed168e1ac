"""Dataset uploads: bounded read, validation with line numbers, object then row (never half-written)."""

from __future__ import annotations

import itertools
from typing import Iterator

from fastapi import UploadFile
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.errors import ApiError
from gspo_core.data import DataError, validate_jsonl_bytes
from store.models import File, Job, Tenant, new_id
from store.objects import BadKey
from store.settings import Settings


async def read_bounded(upload: UploadFile, limit: int) -> bytes:
    """Read at most ``limit`` bytes; 413 past it (never buffers an unbounded body)."""
    chunks, size = [], 0
    while chunk := await upload.read(1024 * 1024):
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "file_too_large", f"file exceeds the {limit} byte upload limit", "file")
        chunks.append(chunk)
    return b"".join(chunks)


def _item_fields(rows: list[dict]) -> list[str]:
    """Fields present in EVERY row (a template may only use those)."""
    common = set(rows[0])
    for r in rows[1:]:
        common &= set(r)
    return sorted(common)


def create_file(s: Session, objects, settings: Settings, tenant: Tenant, filename: str, data: bytes) -> File:
    try:
        rows = validate_jsonl_bytes(data, max_rows=settings.max_file_rows)
    except DataError as exc:
        status = 413 if "too many rows" in exc.message else 400
        raise ApiError(status, "invalid_file", str(exc), exc.field or "file", exc.line) from None
    file_id = new_id("file")
    key = f"tenants/{tenant.id}/files/{file_id}.jsonl"
    objects.put_bytes(key, data)
    try:
        f = File(id=file_id, tenant_id=tenant.id, filename=filename[:255] or "data.jsonl", bytes=len(data),
                 rows=len(rows), object_key=key, item_fields=_item_fields(rows))
        s.add(f)
        s.commit()  # here, not after the response: a failed insert must not leave the object behind
    except Exception:
        s.rollback()
        objects.delete_prefix(key)
        raise
    return f


def open_content(objects, key: str) -> Iterator[bytes]:
    """The object's byte stream, opened now: a bad or missing key is a 404 before any header is sent
    (a lazily opened stream would fail mid-response instead)."""
    stream = objects.open_stream(key)
    try:
        first = next(stream, b"")
    except (BadKey, FileNotFoundError) as exc:
        raise ApiError(404, "not_found", f"stored content is missing ({type(exc).__name__})") from None
    except Exception as exc:
        if type(exc).__name__ != "NoSuchKey":  # S3's missing object (botocore stays out of the API)
            raise
        raise ApiError(404, "not_found", "stored content is missing (NoSuchKey)") from None
    return itertools.chain([first], stream)


def delete_file(s: Session, objects, f: File) -> None:
    used = s.scalar(select(Job.id).where((Job.training_file_id == f.id) | (Job.validation_file_id == f.id)).limit(1))
    if used:
        raise ApiError(409, "file_in_use", f"file {f.id} is used by job {used}", "file_id")
    s.delete(f)
    s.commit()  # the row goes first: a failed delete leaves the file whole, never a row without content
    objects.delete_prefix(f.object_key)
