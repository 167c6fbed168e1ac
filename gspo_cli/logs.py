"""Logging of the `gspo up` and `gspo demo` processes: the service's own output, libraries' logs at --verbose."""

from __future__ import annotations

import logging
import os


def level_of(verbose: bool) -> int:
    """GSPO_LOG_LEVEL (default WARNING); ``--verbose`` lowers it to INFO, where every library's progress shows."""
    from store.settings import get_settings

    level = logging.getLevelName(get_settings().log_level.upper())
    return min(level, logging.INFO) if verbose else level


def configure(level: int) -> None:
    """This process's logging, at ``level``, before any library loads. Above INFO (the default WARNING) the
    libraries' progress bars are off too: transformers' model loads and saves, the Hugging Face hub's (the
    variable is read when they load)."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level > logging.INFO:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def uvicorn_level(level: int) -> str:
    """uvicorn's name of ``level`` (at INFO it logs every request)."""
    return logging.getLevelName(level).lower()
