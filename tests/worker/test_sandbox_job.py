"""The attack suite in a real training job on a real Celery worker: every attack is a sub-grader of the
job's `multi` reward; each scores 0 with its error recorded, nothing leaks, and the job and worker carry on."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from gspo_core.rewards.isolation import isolation_for
from gspo_core.toy import TOY_REWARD
from store.tenants import create_tenant_and_key
from tests.conftest import grader_policy
from tests.sandbox_attacks import (
    ATTACKS,
    FIND,
    attack_item,
    attack_spec,
    check_attack_results,
    listening_port,
    new_secret,
    planted_markers,
)

REPO = Path(__file__).resolve().parents[2]


def test_attacks_in_a_training_job_score_zero_and_the_worker_carries_on(rig):
    secret = new_secret()
    rig.env["GSPO_TEST_SECRET"] = secret  # in the worker's environment
    with rig.app.state.db.session() as s:
        _, victim_key = create_tenant_and_key(s, f"victim-{uuid.uuid4().hex[:6]}")
    victim = {"Authorization": f"Bearer {victim_key}"}
    up = rig.client.post(
        "/v1/files", files={"file": ("v.jsonl", json.dumps({"prompt": secret, "target": "a"}) + "\n")}, headers=victim
    )
    assert up.status_code == 201, up.text
    rig.app.state.objects.put_bytes(
        "jobs/job-victim/checkpoints/step-000001-a1/model/model.safetensors", secret.encode()
    )
    worker = rig.start_worker()
    srv, port = listening_port()
    env = str(Path(isolation_for(grader_policy()).python).parents[1])
    item = attack_item(rig.settings.data_dir, [worker.pid, os.getpid()], port, env)
    rows = [{"prompt": f"say {c}:", "target": c * 4, **item} for c in "abcd"]
    file_id = rig.client.post(
        "/v1/files", files={"file": ("a.jsonl", "".join(json.dumps(r) + "\n" for r in rows))}, headers=rig.h
    ).json()["id"]
    reward = attack_spec()
    reward["graders"].update(match=TOY_REWARD, find={"type": "python", "source": FIND, "timeout_s": 2.0})
    reward["calculate_output"] = "match + " + reward["calculate_output"] + " + 0 * find"
    r = rig.client.post(
        "/v1/jobs",
        headers=rig.h,
        json={
            "model": "toy",
            "training_file": file_id,
            "reward": reward,
            "hyperparameters": {
                "steps": 2,
                "prompts_per_step": 1,
                "group_size": 2,
                "max_new_tokens": 4,
                "mini_batches": 1,
                "samples_per_step": 1,
            },
        },
    )
    assert r.status_code == 201, r.text
    try:
        job = rig.wait_status(r.json()["id"], {"succeeded", "failed"}, timeout=240)
    finally:
        srv.close()
    assert job["status"] == "succeeded", (job, rig.logs())
    comps = []
    for step in (1, 2):
        rows = rig.client.get(f"/v1/jobs/{job['id']}/samples?step={step}", headers=rig.h).json()["rows"]
        comps += [c for row in rows for c in row["completions"]]
    assert len(comps) == 4, comps
    check_attack_results(comps, [secret], names=[*ATTACKS, "find"])
    assert all("no marker" in c["errors"]["find"] for c in comps), comps
    events = rig.client.get(f"/v1/jobs/{job['id']}/events", headers=rig.h).text
    assert secret not in events and secret not in rig.logs()
    assert planted_markers(rig.settings.data_dir, REPO) == []
    assert worker.poll() is None, "the worker survived its graders (and finished the job they graded)"
