"""A session worker reads a Tinker checkpoint from a local directory holding the save it is asked for: the one it was
saved to when that is whole, else its own copy fetched from object storage (local directory and S3 stores); deleting
a checkpoint removes a host's copy and that name's staging directories."""

from __future__ import annotations

import shutil
import uuid
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from store.objects import put_dir
from store.tinker_files import checkpoint_prefix, object_key, remove_local_copy, staging_dir
from worker.checkpoint_files import Checkpoint, CheckpointFiles, saved_at, stamp

FILES = {"trainer/.metadata": b"meta", "trainer/__0_0.distcp": b"w" * 300, "adapter/config.json": b"{}"}


def _write(directory: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    return directory


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def _saved(objects, saver_dir: Path, files: dict[str, bytes], when: datetime) -> Checkpoint:
    """A training checkpoint as a session worker saves it: its files in ``saver_dir``, uploaded, then stamped."""
    prefix = checkpoint_prefix(f"t-{uuid.uuid4().hex[:8]}", "m", "training", "one")
    directory = _write(CheckpointFiles(objects, saver_dir).save_dir(prefix), files)
    put_dir(objects, object_key(prefix, "training"), directory)
    ckpt = Checkpoint("training", str(directory), prefix, saved_at(when))
    stamp(directory, ckpt.version)
    return ckpt


def test_a_checkpoint_is_read_where_saved_or_fetched_whole_into_the_workers_data_dir(objects, tmp_path):
    when = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    ckpt = _saved(objects, tmp_path / "saver", FILES, when)
    reader = CheckpointFiles(objects, tmp_path / "reader")
    copy = tmp_path / "reader" / ckpt.object_prefix
    # whole where it was saved: read there, nothing fetched
    assert reader.local_dir(ckpt) == ckpt.directory and not copy.exists()
    # gone there (another host's disk): fetched into the reader's data directory, the same files, stamped
    shutil.rmtree(ckpt.directory)
    assert reader.local_dir(ckpt) == str(copy)
    assert {k: v for k, v in _files(copy).items() if not k.startswith(".")} == FILES
    # a copy that lost a file and its stamp (a fetch or a clean-up cut short) is fetched again
    (copy / "trainer/__0_0.distcp").unlink()
    (copy / ".saved-at").unlink()
    assert reader.local_dir(ckpt) == str(copy) and (copy / "trainer/__0_0.distcp").read_bytes() == b"w" * 300
    # the same checkpoint as the database gives it back (SQLite: naive UTC; PostgreSQL: another zone) is that save
    for same in (when.replace(tzinfo=None), when.astimezone(timezone(timedelta(hours=-5)))):
        assert saved_at(same) == ckpt.version


def test_a_copy_of_an_earlier_save_of_the_name_is_replaced_and_a_deleted_one_is_not_found(objects, tmp_path):
    old = _saved(objects, tmp_path / "saver", {**FILES, "trainer/extra.bin": b"old"}, datetime(2026, 1, 1, tzinfo=UTC))
    reader = CheckpointFiles(objects, tmp_path / "reader")
    Path(old.directory, ".saved-at").unlink()  # not whole where saved: the reader fetches its own copy
    copy = Path(reader.local_dir(old))
    assert _files(copy)["trainer/__0_0.distcp"] == b"w" * 300
    # the name saved again (same sizes, new bytes): the reader's copy of the earlier save is not read
    objects.delete_prefix(old.object_prefix)
    newer = {**FILES, "trainer/__0_0.distcp": b"n" * 300}
    put_dir(objects, object_key(old.object_prefix, "training"), _write(tmp_path / "newer", newer))
    new = Checkpoint("training", old.directory, old.object_prefix, saved_at(datetime(2026, 1, 2, tzinfo=UTC)))
    assert reader.local_dir(new) == str(copy)
    assert {k: v for k, v in _files(copy).items() if not k.startswith(".")} == newer  # extra.bin went with the old
    # deleted from object storage and from every disk: not found, and no staging directory is left behind
    objects.delete_prefix(old.object_prefix)
    gone = Checkpoint("training", str(tmp_path / "nowhere"), old.object_prefix, saved_at(datetime.now(UTC)))
    with pytest.raises(FileNotFoundError):
        reader.local_dir(gone)
    assert sorted(p.name for p in copy.parent.iterdir()) == ["one"]


def test_deleting_removes_a_hosts_copy_and_the_names_staging_dirs_only(objects, tmp_path):
    ckpt = _saved(objects, tmp_path / "saver", FILES, datetime(2026, 1, 1, tzinfo=UTC))
    one = Path(ckpt.directory)
    assert one == tmp_path / "saver" / ckpt.object_prefix  # saved where the saver keeps its fetched copies
    other = _write(one.parent / "one-b", FILES)  # another name of the same model and kind, ...
    cut_short = staging_dir(one)  # ... a fetch of "one" that died midway, and one of "one-b" in flight
    in_flight = staging_dir(other)
    remove_local_copy(tmp_path / "saver", ckpt.object_prefix)
    assert not one.exists() and not cut_short.exists()
    assert other.is_dir() and in_flight.is_dir() and _files(other) == FILES
    remove_local_copy(tmp_path / "elsewhere", ckpt.object_prefix)  # no copy on this host: nothing to do
