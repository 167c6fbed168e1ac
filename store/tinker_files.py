"""Where a Tinker checkpoint's files are: its object prefix, and a host's copy under that host's data directory."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from store.objects import check_key
from store.private import private_dir

#: Where each kind's files are under a checkpoint's object prefix: a training state, a sampler's Hugging Face export.
PARTS = {"training": "state", "sampler": "model"}
#: Between a checkpoint's name and a staging directory's random part: no name holds it (letters, digits, ``._-``),
#: so a name's staging directories are told from another name's.
STAGING_MARK = "~"


def checkpoint_prefix(tenant_id: str, model_id: str, kind: str, name: str) -> str:
    """The object prefix of a tenant's model's ``kind`` checkpoint ``name``; a host's copy is at the same path under
    its data directory."""
    return check_key(f"tinker/{tenant_id}/{model_id}/{kind}/{name}")


def object_key(object_prefix: str, kind: str) -> str:
    """The key under which a ``kind`` checkpoint's files are stored."""
    return f"{object_prefix}/{PARTS[kind]}"


def local_copy(data_dir: str | Path, object_prefix: str) -> Path:
    """Where a host keeps a checkpoint's files (saved there, or fetched from object storage): under its data
    directory, at the checkpoint's object prefix."""
    return Path(data_dir) / check_key(object_prefix)


def staging_dir(target: Path) -> Path:
    """A new private directory beside ``target``, named after it, to fill and then rename into its place."""
    return Path(tempfile.mkdtemp(prefix=f".{target.name}{STAGING_MARK}", dir=private_dir(target.parent)))


def remove_local_copy(data_dir: str | Path, object_prefix: str) -> None:
    """Remove this host's copy of a checkpoint and every staging directory of its name: fetches cut short, or one
    still running, which then fails (its objects are gone) or at worst leaves a copy no one reads (its row is)."""
    copy = local_copy(data_dir, object_prefix)
    shutil.rmtree(copy, ignore_errors=True)
    if copy.parent.is_dir():
        for staging in copy.parent.glob(f".{copy.name}{STAGING_MARK}*"):
            shutil.rmtree(staging, ignore_errors=True)
