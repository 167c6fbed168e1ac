"""The unmodified `tinker` SDK (0.38) against a live `gspo api` and a session worker (`gspo worker` with
GSPO_WORKER_MODE=sessions) on the toy model: train, sample with log-probs, save and load, tenancy, errors."""

from __future__ import annotations

import math
import shutil
import tarfile
from io import BytesIO

import httpx
import pytest

from store.db import Database
from store.models import TinkerSession, UsageRecord, utcnow
from store.settings import Settings
from store.tinker_files import staging_dir
from store.usage import QueuePolicy
from tests.api.conftest import TINKER_BUDGET_H as BUDGET_H
from tests.api.tinker_support import datum as _datum
from tests.api.tinker_support import mean_loss as _mean_loss

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10]  # toy-tokenizer ids of plain characters


@pytest.fixture()
def sdk(tinker_service):
    """``client(key)``: a ServiceClient of the tenant's; each is closed after the test (its session finished,
    its heartbeat and config-refresh tasks stopped), so none keeps running into later tests."""
    url, _, _ = tinker_service
    made: list = []

    def client(key: str):
        made.append(tinker.ServiceClient(base_url=url, api_key=f"tml-{key}"))
        return made[-1]

    yield client
    for service in made:
        service.close("success").result(timeout=60)


def test_train_sample_save_and_load_with_the_sdk(tinker_service, sdk):
    url, keys, tmp = tinker_service
    service = sdk(keys[0])
    rest = service.create_rest_client()
    assert "toy" in [m.model_name for m in rest.get_server_capabilities().result().supported_models]
    training = service.create_lora_training_client(base_model="toy", rank=4, seed=0).result()
    assert training.get_info().model_data.model_name == "toy"
    data = [_datum([*PROMPT, 11, 12]), _datum([7, 8, 9, 10, 11, 12, 13])]
    losses = []
    for _ in range(4):
        fb = training.forward_backward(data, "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=5e-3))
        out = fb.result()
        step.result()
        assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [
            len(d.model_input.to_ints()) for d in data
        ]
        losses.append(_mean_loss(out, data))
    assert losses[-1] < losses[0], losses

    state = training.save_state("after-4").result()
    assert state.path.startswith("tinker://") and "/weights/after-4" in state.path
    sampler_path = training.save_weights_for_sampler("s4").result().path
    sampling = service.create_sampling_client(model_path=sampler_path).result()
    res = sampling.sample(
        types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=types.SamplingParams(max_tokens=5, seed=1)
    ).result()
    assert len(res.sequences) == 2
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 5 and len(seq.logprobs) == len(seq.tokens)
        assert all(lp <= 0 and math.isfinite(lp) for lp in seq.logprobs)
    prompt_logprobs = sampling.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    assert prompt_logprobs[0] is None and all(lp is not None and lp <= 0 for lp in prompt_logprobs[1:])

    # load_state brings back the weights saved at step 4: the same forward log-probs after more training
    before = training.forward(data, "cross_entropy").result()
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    moved = training.forward(data, "cross_entropy").result()
    training.load_state(state.path).result()
    back = training.forward(data, "cross_entropy").result()
    first = lambda o: o.loss_fn_outputs[0]["logprobs"].tolist()  # noqa: E731
    assert first(moved) != pytest.approx(first(before), abs=1e-4)
    assert first(back) == pytest.approx(first(before), abs=1e-4)

    run_id = training.model_id
    paths = [c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints]
    assert state.path in paths and sampler_path in paths
    archive = httpx.get(
        f"{url}/api/v1/training_runs/{run_id}/checkpoints/sampler_weights/s4/archive",
        headers={"X-API-Key": f"tml-{keys[0]}"},
        timeout=60,
    )
    assert archive.status_code == 200, archive.text
    with tarfile.open(fileobj=BytesIO(archive.content), mode="r:gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("config.json") for n in names), names

    # another tenant: the model, its future and its checkpoints are 404s
    other = {"X-API-Key": f"tml-{keys[1]}"}
    r = httpx.post(f"{url}/api/v1/get_info", json={"model_id": run_id}, headers=other)
    assert r.status_code == 404
    r = httpx.get(f"{url}/api/v1/training_runs/{run_id}/checkpoints", headers=other)
    assert r.status_code == 404
    with pytest.raises(tinker.NotFoundError):
        sdk(keys[1]).create_sampling_client(model_path=sampler_path).result()
    # deleting it removes its objects and, the API sharing the worker's data dir here, the worker's copy and any
    # staging directory of its name (a fetch cut short)
    (local,) = tmp.glob(f"tinker/*/{run_id}/sampler/s4")
    cut_short = staging_dir(local)
    rest.delete_checkpoint(run_id, "sampler_weights/s4").result()
    assert sampler_path not in [c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints]
    assert not local.exists() and not cut_short.exists() and (local.parent.parent / "training" / "after-4").is_dir()


def test_load_state_of_a_checkpoint_whose_local_copy_is_gone_reads_it_from_object_storage(tinker_service, sdk):
    _, keys, tmp = tinker_service
    service = sdk(keys[0])
    training = service.create_lora_training_client(base_model="toy", rank=4, seed=0).result()
    tokens = [*PROMPT, 11, 12]
    training.forward_backward([_datum(tokens)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    state = training.save_state("kept").result()
    saved = _forward_logprobs(training, tokens)
    training.forward_backward([_datum(tokens)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert _forward_logprobs(training, tokens) != pytest.approx(saved, abs=1e-4)
    # the worker's copy is gone (as on a worker of another host): the state comes from object storage
    (local,) = tmp.glob(f"tinker/*/{training.model_id}/training/kept")
    shutil.rmtree(local)
    training.load_state(state.path).result()
    assert _forward_logprobs(training, tokens) == pytest.approx(saved, abs=1e-5)
    # create_training_client_from_state (a new model, loading it) reads the copy fetched then
    restored = service.create_training_client_from_state(state.path).result()
    assert _forward_logprobs(restored, tokens) == pytest.approx(saved, abs=1e-5)
    assert (local / "trainer" / ".metadata").is_file()
    assert len(_worker_log(tmp, training.model_id, "fetched from object storage")) == 1


def _forward_logprobs(training, tokens: list[int]) -> list[float]:
    """The training model's log-prob of each token of ``tokens`` after the first."""
    return training.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def _worker_log(tmp, session_id: str, what: str) -> list[str]:
    return [line for line in (tmp / "worker.log").read_text().splitlines() if what in line and session_id in line]


def test_samplers_share_one_engine_batch_concurrent_samples_and_keep_their_weights(tinker_service, sdk):
    _, keys, tmp = tinker_service
    service = sdk(keys[0])
    training = service.create_lora_training_client(base_model="toy", rank=4, seed=0).result()
    session_id = training.model_id.split(":")[0]
    probe = [*PROMPT, 11, 12, 13]
    step = lambda: training.optim_step(types.AdamParams(learning_rate=5e-2)).result()  # noqa: E731
    training.forward_backward([_datum(probe)], "cross_entropy").result()
    step()
    sampler_a = service.create_sampling_client(model_path=training.save_weights_for_sampler("a").result().path).result()
    params = types.SamplingParams(max_tokens=4, temperature=1.0)
    prompts = [[5 + i, 6 + i, 7 + i] for i in range(6)]
    futures = [sampler_a.sample(types.ModelInput.from_ints(p), num_samples=2, sampling_params=params) for p in prompts]
    for prompt, future in zip(prompts, futures, strict=True):  # each future has its own prompt's continuations
        sequences = future.result().sequences
        assert len(sequences) == 2
        for seq in sequences:
            expected = _forward_logprobs(training, [*prompt, *seq.tokens])[len(prompt) - 1 :]
            assert seq.logprobs == pytest.approx(expected, abs=2e-3)
    weights_a = _forward_logprobs(training, probe)

    training.forward_backward([_datum(probe)], "cross_entropy").result()
    step()
    sampler_b = service.create_sampling_client(model_path=training.save_weights_for_sampler("b").result().path).result()
    weights_b = _forward_logprobs(training, probe)
    assert weights_b != pytest.approx(weights_a, abs=1e-3)
    # the older sampler after the newer push samples with its own weights, then the newer with its own
    for sampler, weights in ((sampler_b, weights_b), (sampler_a, weights_a), (sampler_b, weights_b)):
        assert sampler.compute_logprobs(types.ModelInput.from_ints(probe)).result()[1:] == pytest.approx(
            weights, abs=2e-3
        )
    assert len(_worker_log(tmp, session_id, "sampling engine")) >= 2  # the older sampler's weights read back
    assert len(_worker_log(tmp, session_id, "started for session")) == 1  # one engine for both samplers
    batches = [
        int(line.split("sample batch of ")[1].split()[0]) for line in _worker_log(tmp, session_id, "sample batch of")
    ]
    assert sum(batches) >= len(prompts) and max(batches) > 1, batches


def test_bad_requests_raise_the_sdks_exceptions(tinker_service, sdk):
    _, keys, _ = tinker_service
    with pytest.raises(tinker.AuthenticationError):  # the SDK connects on first use
        sdk("not-a-key").create_lora_training_client("toy", rank=4)
    service = sdk(keys[0])
    with pytest.raises(tinker.BadRequestError):
        service.create_lora_training_client(base_model="no-such-model", rank=4).result()
    training = service.create_lora_training_client(base_model="toy", rank=4).result()
    with pytest.raises(tinker.BadRequestError):
        training.forward_backward([_datum(PROMPT)], "no_such_loss").result()
    mismatched = types.Datum(model_input=types.ModelInput.from_ints(PROMPT), loss_fn_inputs={"target_tokens": [1]})
    with pytest.raises(tinker.BadRequestError):
        training.forward_backward([mismatched], "cross_entropy").result()


def test_session_cap_and_futures_protocol(tinker_service):
    url, keys, _ = tinker_service
    headers = {"X-API-Key": f"tml-{keys[2]}"}
    body = {"tags": [], "sdk_version": "0.38.0"}
    sessions = [httpx.post(f"{url}/api/v1/create_session", json=body, headers=headers) for _ in range(3)]
    assert all(r.status_code == 200 for r in sessions)
    r = httpx.post(f"{url}/api/v1/create_session", json=body, headers=headers)
    assert r.status_code == 429 and "sessions" in r.text
    # an unknown future is a 404; another tenant's future too
    r = httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": "tr_nope"}, headers=headers)
    assert r.status_code == 404
    session_id = sessions[0].json()["session_id"]
    create = {"session_id": session_id, "model_seq_id": 0, "base_model": "toy", "lora_config": {"rank": 2}}
    future = httpx.post(f"{url}/api/v1/create_model", json=create, headers=headers).json()
    r = httpx.post(
        f"{url}/api/v1/retrieve_future",
        json={"request_id": future["request_id"]},
        headers={"X-API-Key": f"tml-{keys[1]}"},
        timeout=30,
    )
    assert r.status_code == 404
    r = httpx.post(
        f"{url}/api/v1/retrieve_future", json={"request_id": future["request_id"]}, headers=headers, timeout=30
    )
    assert r.status_code in (200, 408)
    if r.status_code == 408:
        assert r.json()["type"] == "try_again" and r.json()["queue_state"] in ("active", "paused_capacity")


def test_sessions_weights_info_and_routes_not_offered_through_the_sdk(tinker_service, sdk):
    url, keys, _ = tinker_service
    service = sdk(keys[1])
    rest = service.create_rest_client()
    training = service.create_lora_training_client(base_model="toy", rank=4, seed=0).result()
    session_id = training.model_id.split(":")[0]
    assert session_id in rest.list_sessions().result().sessions
    assert rest.get_session(session_id).result().training_run_ids == [training.model_id]
    path = training.save_state("w1").result().path
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == ("toy", True, 4)
    with pytest.raises(tinker.BadRequestError, match="not offered"):
        rest.publish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError):  # another tenant's session
        sdk(keys[0]).create_rest_client().get_session(session_id).result()

    service.close("success", detail="done").result(timeout=60)  # finishes the session: its models go
    headers = {"X-API-Key": f"tml-{keys[1]}"}
    described = httpx.get(f"{url}/api/v1/sessions/{session_id}", headers=headers).json()
    assert described["status"] == "closed" and "success" in described["closed_reason"]
    r = httpx.post(f"{url}/api/v1/get_info", json={"model_id": training.model_id}, headers=headers)
    assert r.status_code == 409, r.text


def test_a_spent_budget_raises_billing_error(tinker_service, sdk):
    _, keys, tmp = tinker_service
    service = sdk(keys[3])
    training = service.create_lora_training_client(base_model="toy", rank=4).result()
    session_id = training.model_id.split(":")[0]
    db = Database(Settings(data_dir=tmp).resolved_database_url())
    with db.session() as s:  # the tenant spends its device hours (on jobs or sessions alike)
        tenant_id = s.get(TinkerSession, session_id).tenant_id
        period = QueuePolicy(budget_s=BUDGET_H * 3600).period_start(utcnow())
        row = UsageRecord(tenant_id=tenant_id, job_id="spent", run_id="w", attempt=1, period_start=period)
        row.device_seconds, row.tokens_sampled, row.tokens_trained = BUDGET_H * 3600, 0, 0
        s.add(row)
        s.commit()
    db.dispose()
    with pytest.raises(tinker.BillingError, match="budget used"):
        training.forward_backward([_datum(PROMPT)], "cross_entropy").result()
    with pytest.raises(tinker.BillingError, match="budget used"):
        sdk(keys[3]).create_lora_training_client(base_model="toy", rank=4)
