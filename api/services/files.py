"""Dataset files: uploads streamed to a temporary file, validated line by line off the event loop (a large
one in a child process), within the tenant's concurrent-upload cap and storage quota, stored object
then row (never half-written); a tenant's list; a file's content."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Iterator
from typing import BinaryIO

import anyio
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.datastructures import FormData, UploadFile

from api.errors import ApiError
from api.limits import Limits
from api.schemas import FileOut, FilePage, as_utc
from api.services.scan import scan_in_child
from gspo_core.data import DataError, jsonl_summary
from store.db import Database
from store.models import File, Tenant, new_id
from store.objects import BadKey, ObjectStore
from store.settings import Settings
from store.tenants import stored_bytes

#: Uploads up to this size are validated in a thread (milliseconds); larger ones in a child process.
SCAN_IN_THREAD_BYTES = 1024 * 1024


def _stored_bytes_now(db: Database, tenant_id: str) -> int:
    with db.session() as s:
        return stored_bytes(s, tenant_id)


def _quota_error(settings: Settings, used: int, size: int | None, status: int = 413, field: str = "file") -> ApiError:
    this = f"; this file is {size} bytes" if size is not None else ""
    return ApiError(
        status,
        "storage_quota_exceeded",
        f"your files and checkpoints use {used} of the {settings.max_file_storage_bytes_per_tenant} bytes "
        f"allowed{this}; delete files, checkpoints or finished jobs to make room",
        field,
    )


def check_room_for_a_job(s: Session, settings: Settings, tenant_id: str) -> None:
    """A 409 when the tenant's files and checkpoints already fill its quota: the job could keep no checkpoint,
    so it is refused before it takes a device (one that crosses the quota fails at that checkpoint)."""
    if (used := stored_bytes(s, tenant_id)) >= settings.max_file_storage_bytes_per_tenant:
        raise _quota_error(settings, used, None, 409, "training_file")


def _scan(fh: BinaryIO, settings: Settings) -> tuple[int, list[str], int]:
    """``(rows, fields every row has, bytes)`` of the upload, read line by line (bounded memory)."""
    size = fh.seek(0, 2)
    if size > settings.max_upload_bytes:
        raise ApiError(413, "file_too_large", f"file exceeds the {settings.max_upload_bytes} byte upload limit", "file")
    fh.seek(0)
    try:
        if size > SCAN_IN_THREAD_BYTES:
            rows, fields = scan_in_child(fh, settings.max_file_rows, settings.max_row_bytes)
        else:
            rows, fields = jsonl_summary(fh, max_rows=settings.max_file_rows, max_row_bytes=settings.max_row_bytes)
    except DataError as exc:
        status = 413 if "too many rows" in exc.message else 400
        raise ApiError(status, "invalid_file", str(exc), exc.field or "file", exc.line) from None
    return rows, fields, size


def _store(db: Database, objects: ObjectStore, settings: Settings, tenant_id: str, filename: str, fh: BinaryIO) -> File:
    """Validate, store the object, insert the row (the quota re-checked under the tenant's lock)."""
    rows, fields, size = _scan(fh, settings)
    if (used := _stored_bytes_now(db, tenant_id)) + size > settings.max_file_storage_bytes_per_tenant:
        raise _quota_error(settings, used, size)
    file_id = new_id("file")
    key = f"tenants/{tenant_id}/files/{file_id}.jsonl"
    fh.seek(0)
    objects.put_fileobj(key, fh)
    try:
        with db.session() as s:
            s.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())  # PostgreSQL: one at a time
            f = File(
                id=file_id,
                tenant_id=tenant_id,
                filename=filename[:255] or "data.jsonl",
                bytes=size,
                rows=rows,
                object_key=key,
                item_fields=fields,
            )
            s.add(f)
            s.flush()  # SQLite: the write lock is ours from here, so the sum below is the final one
            if (total := stored_bytes(s, tenant_id)) > settings.max_file_storage_bytes_per_tenant:
                raise _quota_error(settings, total - size, size)
    except BaseException:
        objects.delete_prefix(key)
        raise
    return f


def file_out(f: File) -> FileOut:
    return FileOut(
        id=f.id,
        filename=f.filename,
        bytes=f.bytes,
        rows=f.rows,
        item_fields=f.item_fields or [],
        created_at=int(as_utc(f.created_at).timestamp()),
        purpose="fine-tune-results" if f.purpose == "fine-tune-results" else "fine-tune",
    )


def list_files(s: Session, tenant: Tenant, limit: int, after: str | None = None) -> FilePage:
    """The tenant's newest ``limit`` files, after the file ``after`` (OpenAI's cursor: the last id seen)."""
    q = select(File).where(File.tenant_id == tenant.id)
    if after:
        last = s.get(File, after)
        if last is None or last.tenant_id != tenant.id:
            raise ApiError(404, "not_found", f"file {after} not found", "after")
        q = q.where((File.created_at < last.created_at) | ((File.created_at == last.created_at) & (File.id < last.id)))
    rows = list(s.scalars(q.order_by(File.created_at.desc(), File.id.desc()).limit(limit + 1)))
    return FilePage(data=[file_out(f) for f in rows[:limit]], has_more=len(rows) > limit)


def check_purpose(form: FormData) -> None:
    """OpenAI's SDK sends ``purpose``; files here are datasets for fine-tuning jobs only."""
    purpose = form.get("purpose")
    if purpose is not None and purpose != "fine-tune":
        raise ApiError(
            422, "invalid_request", f"purpose: only 'fine-tune' files are stored here, not {purpose!r}", "purpose"
        )


async def upload(
    read_form: Callable[[], Awaitable[FormData]],
    db: Database,
    objects: ObjectStore,
    settings: Settings,
    limits: Limits,
    tenant: Tenant,
) -> FileOut:
    """The multipart part ``file`` of the form ``read_form`` reads: read only once the tenant holds an
    upload slot and has room left."""
    used = await anyio.to_thread.run_sync(_stored_bytes_now, db, tenant.id)
    if used >= settings.max_file_storage_bytes_per_tenant:
        raise _quota_error(settings, used, None)
    async with limits.slot("uploads", tenant.id, settings.max_uploads_per_tenant, settings.max_uploads_per_process):
        # Starlette spools the part to a temporary file (in memory up to 1 MiB) as it arrives.
        form = await read_form()
        try:
            check_purpose(form)
            part = form.get("file")
            if not isinstance(part, UploadFile):
                raise ApiError(
                    422, "invalid_request", "file: a multipart/form-data part named `file` is required", "file"
                )
            stored = await anyio.to_thread.run_sync(
                _store, db, objects, settings, tenant.id, part.filename or "data.jsonl", part.file
            )
        finally:
            await form.close()
    return file_out(stored)


def open_content(objects: ObjectStore, key: str) -> Iterator[bytes]:
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
