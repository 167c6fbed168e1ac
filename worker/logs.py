"""Logging of the worker's processes: one level, Celery's `--loglevel`, for the worker and the libraries a job loads."""

from __future__ import annotations

import logging
import os

from gspo_core.urls import redact_logged_userinfo


def configure_process(loglevel: int) -> None:
    """Once, in the worker's main process when Celery has set up its logging, before any job process forks.

    The libraries a job loads (vLLM, transformers, torch) read these variables when they load, in the job
    process; a variable the operator set is kept."""
    redact_logged_userinfo()  # graders, tools and webhooks call tenants' URLs, and libraries log them
    # vLLM's records go to the worker's handlers at the worker's level (its own handler logs at INFO,
    # every weight push included, whatever the worker's level).
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    if loglevel <= logging.INFO:
        return
    # Progress bars of model loads and checkpoint saves: libraries' progress, not the service's.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # torch's C++ warnings bypass Python's logging and warnings, so no filter can pick one out: at levels
    # above INFO only their errors show. On CPU, vLLM's memory binding prints one at every engine start,
    # a note on its NUMA placement ("NUMA binding: Using MEMBIND policy").
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
