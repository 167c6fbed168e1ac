"""A job on several devices in the worker: its job process (Celery's prefork child) may start the processes rank 0
needs; the launcher is gspo_core's (`gspo_core.launch.other_ranks`)."""

from __future__ import annotations

import multiprocessing.process
import os
from typing import Any, cast

#: billiard releases whose pool child cannot start a multiprocessing child (see `allow_children`).
BILLIARD_DEFECT = ("4.",)


def allow_children() -> None:
    """Let this job process (Celery's prefork child) start processes with the standard `multiprocessing`, as
    vLLM at N > 1 does for its engine (spawned on GPU). billiard marks the child daemonic, which
    multiprocessing refuses children (celery/celery#1709), and puts its own process object in
    multiprocessing's place, whose authkey the standard library cannot pickle for a spawned child. The job
    process is one job's alone and reaps what it starts (vLLM closes its engine, the ranks die with it), so
    it is given a plain identity: not daemonic, a standard authkey. Narrow and version-guarded (billiard 4);
    tests/worker/test_ranks.py fails when billiard no longer needs it."""
    import billiard

    current = multiprocessing.process.current_process()
    if not billiard.__version__.startswith(BILLIARD_DEFECT) or not type(current).__module__.startswith("billiard"):
        return
    config = cast(Any, current)._config  # billiard's process object, as multiprocessing's current process
    config["daemon"] = False
    config["authkey"] = cast(Any, multiprocessing.process).AuthenticationString(os.urandom(32))
