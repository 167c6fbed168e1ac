"""A Tinker checkpoint's files on a session worker: where it was saved, or fetched from object storage."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from store.models import TinkerCheckpoint
from store.objects import ObjectStore, get_dir
from store.private import open_private
from store.tinker_files import local_copy, object_key, staging_dir

log = logging.getLogger(__name__)
#: In a checkpoint's local directory once all its files are there: which save of its name they are (the row's
#: ``created_at``). A directory without it (a save or a fetch that died midway) or with another save's (the name
#: saved again elsewhere since) is not read. Checkpoint names start with a letter or digit, so it names no part.
STAMP = ".saved-at"


def saved_at(created_at: datetime) -> str:
    """A checkpoint row's ``created_at`` as its stamp holds it: UTC, whether the database returns it naive (SQLite)
    or aware (PostgreSQL, in the connection's time zone)."""
    aware = created_at if created_at.tzinfo is not None else created_at.replace(tzinfo=UTC)
    return aware.astimezone(UTC).isoformat()


def stamp(directory: str | Path, version: str) -> None:
    """Mark ``directory`` as holding all the files of the save ``version``."""
    with open_private(Path(directory) / STAMP) as f:
        f.write(version.encode())


def unstamp(directory: str | Path) -> None:
    """``directory``'s files are about to change: no reader takes them until they are stamped again."""
    (Path(directory) / STAMP).unlink(missing_ok=True)


def _stamp_of(directory: Path) -> str | None:
    try:
        return (directory / STAMP).read_text()
    except OSError:  # absent, or not readable by this worker (another host's path it cannot enter): not there
        return None


@dataclass(frozen=True)
class Checkpoint:
    """What a worker needs of a checkpoint's row to find its files."""

    kind: str
    directory: str  # where the worker that saved it wrote it (on that worker's host)
    object_prefix: str
    version: str  # saved_at(row.created_at): which save of the name

    @classmethod
    def of(cls, row: TinkerCheckpoint) -> Checkpoint:
        return cls(row.kind, row.directory, row.object_prefix, saved_at(row.created_at))


@dataclass(frozen=True)
class CheckpointFiles:
    """The one way a session worker reads a checkpoint: a local directory holding its files."""

    objects: ObjectStore
    data_dir: Path  # this worker's: its saves and fetched copies go under it, at the checkpoint's object prefix

    def save_dir(self, object_prefix: str) -> Path:
        """Where this worker writes a checkpoint it saves: where it keeps a copy it fetches, so it reads its own
        saves in place, and nothing it writes is on another host's disk."""
        return local_copy(self.data_dir, object_prefix)

    def local_dir(self, ckpt: Checkpoint) -> str:
        """A directory holding the checkpoint's files as last saved: the one it was saved to, where this worker sees
        it whole, else this worker's copy under its data directory, fetched from object storage when it is absent,
        incomplete or of an earlier save of the name. FileNotFoundError where object storage has none either."""
        copy = local_copy(self.data_dir, ckpt.object_prefix)
        for directory in (Path(ckpt.directory), copy):
            if _stamp_of(directory) == ckpt.version:
                return str(directory)
        self._fetch(ckpt, copy)
        return str(copy)

    def _fetch(self, ckpt: Checkpoint, target: Path) -> None:
        """Download the checkpoint into a staging directory beside ``target``, stamp it, and put it in place of
        whatever ``target`` held: a reader never sees a copy half written."""
        key = object_key(ckpt.object_prefix, ckpt.kind)
        staging = staging_dir(target)
        try:
            get_dir(self.objects, key, staging)
            if not any(staging.iterdir()):
                raise FileNotFoundError(f"checkpoint {ckpt.object_prefix}: no local copy, and none under {key}")
            stamp(staging, ckpt.version)
            shutil.rmtree(target, ignore_errors=True)
            try:
                staging.rename(target)
            except OSError:  # another worker sharing this data directory put its copy there meanwhile
                if _stamp_of(target) != ckpt.version:
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("checkpoint %s fetched from object storage into %s", ckpt.object_prefix, target)
