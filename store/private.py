"""The service's files are its own: directories 0700 and files 0600, whatever the process's umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

DIR_MODE, FILE_MODE = 0o700, 0o600


def _narrow(path: Path, mode: int) -> None:
    """Drop every permission bit beyond ``mode`` from a path this process owns."""
    st = os.stat(path)
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & ~mode:
        os.chmod(path, stat.S_IMODE(st.st_mode) & mode)


def private_dir(path: str | Path) -> Path:
    """``path`` as a directory only this user can enter: missing parents are created 0700 too, and
    an existing directory of ours is narrowed to 0700."""
    path = Path(path)
    missing = []
    cur = path
    while not cur.exists() and cur != cur.parent:
        missing.append(cur)
        cur = cur.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(d, DIR_MODE)  # mkdir's mode is masked by the umask
    _narrow(path, DIR_MODE)
    return path


def private_file(path: str | Path) -> Path:
    """``path`` exists as a file only this user can read (an existing one of ours is narrowed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
    os.close(fd)
    _narrow(Path(path), FILE_MODE)
    return Path(path)


def open_private(path: str | Path) -> BinaryIO:
    """``path`` opened for writing (truncated), readable by this user only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "wb")
