"""Tinker training runs and their checkpoints: list them, shape them as the SDK reads them, download, delete."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.errors import not_found
from api.services.archive import archive_members
from api.services.tinker import resolve_path, tinker_path
from store import tinker
from store.models import TinkerCheckpoint, TinkerModel
from store.objects import ObjectStore
from store.tinker_files import remove_local_copy


def run_of(s: Session, tenant_id: str, run_id: str) -> TinkerModel:
    row = tinker.owned(s, TinkerModel, run_id, tenant_id)
    if row is None or row.kind != "training":
        raise not_found("training run", run_id)
    return row


def training_runs(s: Session, tenant_id: str, limit: int, offset: int) -> list[TinkerModel]:
    return list(
        s.scalars(
            select(TinkerModel)
            .where(TinkerModel.tenant_id == tenant_id, TinkerModel.kind == "training")
            .order_by(TinkerModel.created_at.desc())
            .limit(limit)
            .offset(offset)
        )
    )


def checkpoints_of(s: Session, tenant_id: str, model_id: str | None) -> list[TinkerCheckpoint]:
    query = select(TinkerCheckpoint).where(TinkerCheckpoint.tenant_id == tenant_id)
    if model_id is not None:
        query = query.where(TinkerCheckpoint.model_id == model_id)
    return list(s.scalars(query.order_by(TinkerCheckpoint.created_at)))


def checkpoint_json(row: TinkerCheckpoint) -> dict[str, Any]:
    segment = "weights" if row.kind == "training" else "sampler_weights"
    return {
        "checkpoint_id": f"{segment}/{row.name}",
        "checkpoint_type": row.kind,
        "time": row.created_at.isoformat(),
        "tinker_path": tinker_path(row.model_id, row.kind, row.name),
        "size_bytes": row.size_bytes,
    }


def training_run_json(model: TinkerModel, tenant_name: str, checkpoints: list[TinkerCheckpoint]) -> dict[str, Any]:
    lora = model.lora or {}
    last = {k: [c for c in checkpoints if c.kind == k] for k in ("training", "sampler")}
    return {
        "training_run_id": model.id,
        "base_model": model.base_model,
        "model_owner": tenant_name,
        "is_lora": bool(lora),
        "lora_rank": lora.get("rank"),
        "last_request_time": model.last_request_at.isoformat(),
        "last_checkpoint": checkpoint_json(last["training"][-1]) if last["training"] else None,
        "last_sampler_checkpoint": checkpoint_json(last["sampler"][-1]) if last["sampler"] else None,
    }


def archive_of(
    s: Session, objects: ObjectStore, tenant_id: str, run_id: str, checkpoint_id: str
) -> tuple[list[tuple[str, str, int]], str]:
    """A checkpoint's downloadable parts and the archive's root name; 404 when it has none."""
    ckpt = resolve_path(s, tenant_id, f"tinker://{run_id}/{checkpoint_id}", "checkpoint_id")
    members = archive_members(objects, ckpt.object_prefix)
    if not members:
        raise not_found("archive of checkpoint", checkpoint_id)
    return members, f"{run_id}-{ckpt.name}"


def delete_checkpoint(
    s: Session, objects: ObjectStore, data_dir: Path, tenant_id: str, run_id: str, checkpoint_id: str
) -> None:
    """A checkpoint's objects, its copy under the API's data directory (the one of the workers that share it: the
    saving worker's when it does) with that name's staging directories, and its row. Copies under other data
    directories stay on their hosts, never read again: a worker finds a checkpoint by its row."""
    ckpt = resolve_path(s, tenant_id, f"tinker://{run_id}/{checkpoint_id}", "checkpoint_id")
    objects.delete_prefix(ckpt.object_prefix)
    remove_local_copy(data_dir, ckpt.object_prefix)
    s.delete(ckpt)
    s.commit()
