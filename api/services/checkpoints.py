"""Checkpoints at the API: a job's list, one checkpoint's view, and its download (a presigned URL of the
archive the worker stored, else a .tar.gz streamed from object storage)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.job_schemas import CheckpointOut
from api.schemas import Page
from api.services.archive import archive_members, stream_tar_gz
from store.models import Checkpoint, Job
from store.objects import ARCHIVE_NAME, ObjectStore

#: A checkpoint's id -> the URL it downloads from (the router knows its routes).
DownloadUrl = Callable[[str], str]


@dataclass(frozen=True)
class ArchiveStream:
    """A checkpoint's archive built while it is sent."""

    chunks: Iterator[bytes]
    filename: str
    size_bytes: int  # of the files archived (the archive's own size is known only at its end)


def checkpoint_out(c: Checkpoint, download_url: DownloadUrl) -> CheckpointOut:
    return CheckpointOut(
        id=c.id,
        job_id=c.job_id,
        step=c.step,
        size_bytes=c.size_bytes,
        final=c.final,
        metrics={k: float(v) for k, v in (c.metrics or {}).items()},
        created_at=c.created_at,
        download_url=download_url(c.id),
    )


def list_checkpoints(s: Session, job: Job, download_url: DownloadUrl) -> Page[CheckpointOut]:
    rows = s.scalars(select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step))
    return Page[CheckpointOut](data=[checkpoint_out(c, download_url) for c in rows])


def download(objects: ObjectStore, c: Checkpoint) -> str | ArchiveStream:
    """The checkpoint's Hugging Face directory (``model/``, plus ``adapter/`` for LoRA) as .tar.gz: a
    presigned URL of the archive the worker stored (S3), else the archive built on the fly; 404 when
    nothing is stored."""
    members = archive_members(objects, c.object_prefix)
    if not members:
        raise ApiError(404, "not_found", f"checkpoint {c.id} has no stored files")
    archive_key = f"{c.object_prefix}/{ARCHIVE_NAME}"
    stored = any(k == archive_key for k, _ in objects.list(c.object_prefix))
    if stored and (url := objects.presigned_url(archive_key)):
        return url
    root = f"{c.job_id}-step-{c.step:06d}"
    return ArchiveStream(
        chunks=stream_tar_gz(objects, members, root),
        filename=f"{root}.tar.gz",
        size_bytes=sum(size for _, _, size in members),
    )
