"""A job process of Celery's prefork pool (a real billiard pool child) may start standard multiprocessing
children once `allow_children` ran: vLLM at N > 1 starts its engine so (spawned on GPU)."""

from __future__ import annotations

import multiprocessing
import os

import billiard

from worker.ranks import allow_children


def _spawn_a_child(fix: bool) -> str:
    if fix:
        allow_children()
    try:
        child = multiprocessing.get_context("spawn").Process(target=os.getpid)
        child.start()
        child.join(60)
    except Exception as exc:  # what the defect raises
        return f"{type(exc).__name__}: {exc}"
    return f"exit {child.exitcode}"


def test_a_pool_child_starts_spawned_children_once_allowed():
    with billiard.Pool(1, maxtasksperchild=1) as pool:
        assert pool.apply(_spawn_a_child, (True,)) == "exit 0"


def test_the_pool_child_defect_is_still_there_without_the_workaround():
    """Fails once billiard lets its pool child have children: then drop `worker.ranks.allow_children`."""
    with billiard.Pool(1, maxtasksperchild=1) as pool:
        assert "daemonic processes are not allowed to have children" in pool.apply(_spawn_a_child, (False,))
