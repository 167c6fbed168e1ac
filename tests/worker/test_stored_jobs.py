"""Jobs stored by an earlier version still run: their hyperparameters may hold keys that are no longer the
tenant's (operator settings, fields that could take one value); the worker drops them and uses its own."""

from __future__ import annotations

from store.models import Job, StepMetric

#: What the version before the platform seam stored with every job (GSPOConfig's fields then).
RETIRED = {
    "rollout_engine": "vllm",
    "vllm_gpu_memory_utilization": 0.3,
    "keep_freed_memory": True,
    "cpu_gemm": "auto",
    "beta": 0.0,
    "lora_dropout": 0.0,
    "save_merged": True,
}


def test_a_job_stored_with_retired_keys_runs_with_the_operators_settings(rig):
    job_id = rig.submit(steps=2, slow=False)
    with rig.app.state.db.session() as s:  # as an earlier version wrote it (the worker is not started yet)
        job = s.get(Job, job_id)
        job.hyperparameters = {**job.hyperparameters, **RETIRED, "max_turns": 2}
        # A job's tools (column tools) reach the trainer: its steps then report the episode metrics.
        job.tools = [{"type": "python", "source": "def f(key: str) -> str:\n    return key\n"}]
        s.commit()
    assert RETIRED.items() <= rig.db_job(job_id).hyperparameters.items()
    rig.start_worker()
    job = rig.wait_status(job_id, {"succeeded", "failed"}, timeout=120)
    assert job["status"] == "succeeded", (job, rig.logs())
    assert rig.steps(job_id) == [1, 2]
    # The job asked for vLLM; the operator's GSPO_ROLLOUT_ENGINE (transformers, tests/worker/conftest.py)
    # ran it: no vLLM engine started, and the transformers engine shares the trainer's weights, so no step
    # pushed any (a push into even the toy vLLM engine takes milliseconds).
    assert "LLM engine" not in "".join(p.read_text() for p in rig.tmp.glob("worker-*.log"))
    with rig.app.state.db.session() as s:
        pushes = [m.metrics["time/weight_sync"] for m in s.query(StepMetric).filter_by(job_id=job_id)]
    assert len(pushes) == 2 and all(t < 0.01 for t in pushes), pushes
    with rig.app.state.db.session() as s:
        assert all("turns/mean" in m.metrics for m in s.query(StepMetric).filter_by(job_id=job_id))
