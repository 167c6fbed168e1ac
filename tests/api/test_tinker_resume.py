"""A Tinker session outlives its worker: the unmodified `tinker` SDK (0.38) against a live `gspo api` and a session
worker that is SIGKILLed mid-session; a second worker, with a data directory of its own, takes the session over and
its models go on from their last save_state exactly (the losses a run that was not killed gives), reading a
checkpoint the first worker's disk no longer holds from object storage (S3), or fail saying what was lost; what it
saves goes under its own data directory, and loads and downloads from there and object storage."""

from __future__ import annotations

import os
import shutil
import signal
import tarfile
from io import BytesIO
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from store.db import Database
from store.models import TinkerRequest, TinkerSession
from store.objects import S3ObjectStore
from store.settings import Settings
from tests.api.conftest import api_and_worker, gspo_process, sessions_env
from tests.api.tinker_support import datum, mean_loss
from tests.worker.conftest import wait_for

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.slow
PROBE = [5, 6, 7, 8, 9, 10, 11, 12]
DATA = [datum([5, 6, 7, 8, 9, 10, 11, 12]), datum([7, 8, 9, 10, 11, 12, 13])]
ADAM = types.AdamParams(learning_rate=2e-2)


@pytest.fixture(scope="module")
def resume_service(tmp_path_factory, tiny_model_dir, s3_settings):
    """``(url, key, data dir, env)``: `gspo api` + a session worker whose leases last 6 s (renewed every 2 s), so a
    killed worker's sessions are freed soon; objects in S3 (moto's server), which workers on other hosts share."""
    tmp = tmp_path_factory.mktemp("tinker-resume")
    S3ObjectStore(s3_settings).ensure_bucket()
    s3 = {
        "GSPO_S3_BUCKET": s3_settings.s3_bucket,
        "GSPO_S3_ENDPOINT_URL": s3_settings.s3_endpoint_url,
        "GSPO_S3_ACCESS_KEY_ID": s3_settings.s3_access_key_id,
        "GSPO_S3_SECRET_ACCESS_KEY": s3_settings.s3_secret_access_key,
    }
    env_vals = {**sessions_env(tmp, tiny_model_dir), **s3, "GSPO_LEASE_SECONDS": "6"}
    with api_and_worker(tmp, env_vals, tiny_model_dir, ("acme",)) as (url, keys):
        yield url, keys[0], tmp, env_vals


def _step(training) -> float:
    """One forward_backward + optim_step, pipelined as the cookbook does: the loss before the step."""
    fb = training.forward_backward(DATA, "cross_entropy")
    training.optim_step(ADAM).result()
    return mean_loss(fb.result(), DATA)


def _kill_the_worker_of(db: Database, session_id: str) -> None:
    """SIGKILL the session worker holding the session (its lease names it: ``sessions@<host>:<pid>``)."""
    with db.read_session() as s:
        owner = s.get(TinkerSession, session_id).lease_owner
    pid = int(owner.rsplit(":", 1)[1])
    os.kill(pid, signal.SIGKILL)
    stat = Path(f"/proc/{pid}/stat")
    wait_for(lambda: not stat.exists() or stat.read_text().split(") ")[1][0] == "Z", 10, "the worker dead")


def _checkpoints(data_dir: Path, model_id: str, kind: str) -> dict[str, Path]:
    """The model's ``kind`` checkpoint directories under a data directory (``tinker/<tenant>/<model>/<kind>/<name>``),
    by name."""
    return {d.name: d for d in data_dir.glob(f"tinker/*/{model_id}/{kind}/*") if not d.name.startswith(".")}


def _queued(db: Database, session_id: str) -> int:
    with db.read_session() as s:
        query = select(func.count()).where(TinkerRequest.session_id == session_id, TinkerRequest.status == "pending")
        return int(s.scalar(query) or 0)


def _forward_loss(training) -> float:
    return mean_loss(training.forward(DATA, "cross_entropy").result(), DATA)


def _saves_of_a_worker_with_its_own_data_dir(url: str, key: str, service, saved, behind, own: Path, api: Path) -> None:
    """What the second worker saves is written under its own data directory, not the API's, and every reader of it
    works: load_state on the worker, the archive download (object storage) and the delete on the API."""
    two = saved.save_state("two").result().path
    saved.save_weights_for_sampler("s2").result()
    mine = {**_checkpoints(own, saved.model_id, "training"), **_checkpoints(own, saved.model_id, "sampler")}
    assert {"two", "s2"} <= set(mine) and all((d / ".saved-at").is_file() for d in mine.values())
    assert not _checkpoints(api, saved.model_id, "training") and not _checkpoints(api, saved.model_id, "sampler")
    behind.load_state(two).result()
    assert _forward_loss(behind) == pytest.approx(_forward_loss(saved), abs=1e-6)
    archive_url = f"{url}/api/v1/training_runs/{saved.model_id}/checkpoints/sampler_weights/s2/archive"
    archive = httpx.get(archive_url, headers={"X-API-Key": f"tml-{key}"}, timeout=60)
    assert archive.status_code == 200, archive.text
    with tarfile.open(fileobj=BytesIO(archive.content), mode="r:gz") as tar:
        assert any(name.endswith("config.json") for name in tar.getnames())
    rest = service.create_rest_client()
    rest.delete_checkpoint(saved.model_id, "sampler_weights/s2").result()
    assert httpx.get(archive_url, headers={"X-API-Key": f"tml-{key}"}, timeout=60).status_code == 404
    # the worker's copy stays on its host (the API cannot reach it), never read again: the row is gone
    assert mine["s2"].is_dir()


def test_a_killed_workers_session_goes_on_from_its_saved_state_on_another_worker(resume_service):
    url, key, tmp, env_vals = resume_service
    service = tinker.ServiceClient(base_url=url, api_key=f"tml-{key}")
    db = Database(Settings(data_dir=tmp).resolved_database_url())
    try:
        make = lambda: service.create_lora_training_client(base_model="toy", rank=4, seed=0).result()  # noqa: E731
        reference = make()  # never killed: the losses the others must go on with
        expected = [_step(reference) for _ in range(3)]
        saved, behind, unsaved = make(), make(), make()
        assert _step(saved) == pytest.approx(expected[0], abs=1e-6)  # the same seed, the same run
        saved.save_state("one").result()
        sampler = saved.save_weights_and_get_sampling_client().result()
        sampled = sampler.compute_logprobs(types.ModelInput.from_ints(PROBE)).result()
        _step(behind)
        behind.save_state("b1").result()
        _step(behind)  # a forward_backward and an optim_step the save lacks
        _step(unsaved)
        session_id = saved.model_id.split(":")[0]

        _kill_the_worker_of(db, session_id)
        # the second worker does not see the first one's copy of `saved`'s checkpoints (another host's disk) ...
        gone = {**_checkpoints(tmp, saved.model_id, "training"), **_checkpoints(tmp, saved.model_id, "sampler")}
        assert "one" in gone and len(gone) == 2
        for directory in gone.values():
            shutil.rmtree(directory)
        in_flight = saved.forward_backward(DATA, "cross_entropy")  # queued while no worker holds the session
        wait_for(lambda: _queued(db, session_id) == 1, 30, "the request queued")
        own = tmp / "worker2-data"  # ... and has a data directory of its own, beside the same database and objects
        env2 = {
            **env_vals,
            "GSPO_DATA_DIR": str(own),
            "GSPO_DATABASE_URL": Settings(data_dir=tmp).resolved_database_url(),
        }
        with gspo_process(tmp, env2, "worker2", ["worker"]):
            with pytest.raises(tinker.RequestFailedError, match="worker holding this session died before this"):
                in_flight.result(timeout=120)
            # the saved model goes on from its save_state: the losses of the run that was not killed, exactly
            assert [_step(saved), _step(saved)] == pytest.approx(expected[1:], abs=1e-6)
            assert abs(expected[1] - expected[0]) > 1e-3  # (which a model restarted from its base would not give)
            # its sampler's engine starts again from the sampler's export
            after = sampler.compute_logprobs(types.ModelInput.from_ints(PROBE)).result()
            assert after[1:] == pytest.approx(sampled[1:], abs=1e-4)
            # calls after the last save were lost: the first call says so and does not run, the next ones do
            with pytest.raises(tinker.RequestFailedError, match=r"tinker://.*/weights/b1, which lacks the last 2"):
                behind.forward_backward(DATA, "cross_entropy").result()
            assert _step(behind) == pytest.approx(expected[1], abs=1e-6)
            # nothing saved: every call says the weights are lost
            for _ in range(2):
                with pytest.raises(tinker.RequestFailedError, match="is lost: the worker holding it stopped or died"):
                    unsaved.forward_backward(DATA, "cross_entropy").result()
            log = (tmp / "worker2.log").read_text()
            assert f"sessions ['{session_id}'] lost their worker" in log and "restored from tinker://" in log
            # `saved`'s state and sampler export came from object storage into its own data directory, once each;
            # `behind`'s b1, whole where it was saved, was read there
            fetched = {**_checkpoints(own, saved.model_id, "training"), **_checkpoints(own, saved.model_id, "sampler")}
            assert sorted(fetched) == sorted(gone) and log.count("fetched from object storage") == 2
            assert not any(directory.exists() for directory in gone.values())
            assert "b1" in _checkpoints(tmp, behind.model_id, "training")
            assert not _checkpoints(own, behind.model_id, "training")
            _saves_of_a_worker_with_its_own_data_dir(url, key, service, saved, behind, own, tmp)
    finally:
        db.dispose()
        service.close("success").result(timeout=60)
