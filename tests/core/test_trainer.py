"""The GSPO loop on the tiny model: metrics, samples, evaluation, stopping, losses, schedules, LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from gspo_core.checkpoint import latest_checkpoint
from gspo_core.config import GSPOConfig
from gspo_core.data import DataError
from gspo_core.registry import LOSSES
from gspo_core.rewards import RewardSpecError
from gspo_core.toy import write_toy_dataset
from gspo_core.trainer import batch_indices, make_optimizer
from tests.core.trainer_support import Recorder, one_torch_thread, toy_spec, train


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


REQUIRED_METRICS = [
    "reward/mean",
    "reward/std",
    "reward/match/mean",
    "reward/frac_zero_std",
    "clip/low_frac",
    "clip/high_frac",
    "ratio/mean",
    "ratio/min",
    "ratio/max",
    "loss",
    "grad_norm",
    "lr",
    "entropy",
    "completion/len_mean",
    "completion/len_max",
    "completion/truncated_frac",
    "logprob_gap/mean",
    "logprob_gap/max",
    "grader_errors/match",
    "time/rollout",
    "time/reward",
    "time/old_logprobs",
    "time/train",
    "time/weight_sync",
    "time/step",
    "throughput/tokens_per_s",
    "step",
    "total_steps",
    "update/rows_skipped_frac",
    "tokens/sampled",
    "tokens/trained",
]


def test_metrics_samples_eval_and_checkpoints(tiny_model_dir, tmp_path):
    rec = Recorder()
    val = write_toy_dataset(tmp_path / "val.jsonl", n=8, seed=1)
    spec = toy_spec(
        tiny_model_dir, tmp_path, steps=4, eval_every=2, save_every=2, logprob_gap_every=2, old_logprobs="recompute"
    )
    result = train(spec.model_copy(update={"validation_file": str(val)}), rec)
    # Step 0: the held-out evaluation before training; the last step's metrics hold the one after.
    before, *steps = rec.steps
    assert [s for s, _ in rec.steps] == [0, 1, 2, 3, 4] and [s for s, _ in rec.samples] == [1, 2, 3, 4]
    assert set(before[1]) == {
        "eval/prompts",
        "eval/reward/mean",
        "eval/reward/match/mean",
        "eval/greedy/reward/mean",
        "eval/greedy/reward/match/mean",
    }
    assert before[1]["eval/prompts"] == 8
    assert [(e.when, e.step, e.prompts) for e in rec.evaluations] == [("before", 0, 8), ("after", 4, 8)]
    assert rec.evaluations[1].greedy_reward == rec.steps[-1][1]["eval/greedy/reward/mean"]
    assert rec.evaluations[0].sampled_reward == before[1]["eval/reward/mean"] and rec.evaluations[0].loss is None
    rec.steps = steps
    last = rec.steps[-1][1]
    assert [n for n in REQUIRED_METRICS if n not in last] == []
    # the sampler is asked for its logprobs (costly on vLLM) on step 1 and every logprob_gap_every steps
    assert [("logprob_gap/max" in m) for _, m in rec.steps] == [True, True, False, True]
    assert all(isinstance(v, float) for v in last.values())
    assert last["step"] == 4.0 and last["total_steps"] == 4.0 and last["grader_errors/match"] == 0.0
    assert [("eval/greedy/reward/mean" in m) for _, m in rec.steps] == [False, True, False, True]
    assert 0.0 <= rec.steps[1][1]["eval/reward/mean"] <= 1.0
    assert 1 <= last["completion/len_mean"] <= last["completion/len_max"] <= 4
    n_rows = spec.hyperparameters.prompts_per_step * spec.hyperparameters.group_size
    for _, m in rec.steps:  # usage counts (the service bills them): every completion token, plus its prompt's
        assert m["tokens/sampled"] == pytest.approx(m["completion/len_mean"] * n_rows)
        assert m["tokens/trained"] >= m["tokens/sampled"] + n_rows
    assert last["completion/truncated_frac"] > 0.5  # the random model rarely says EOS within 4 tokens
    _, rows = rec.samples[0]
    assert len(rows) == 4 and len(rows[0]["completions"]) == 8  # samples_per_step prompts, G each
    assert set(rows[0]) == {"prompt", "item", "completions"} and rows[0]["prompt"].startswith("say ")
    comp = rows[0]["completions"][0]
    assert set(comp) == {"text", "reward", "scores", "errors", "tokens", "finish_reason"}
    assert comp["scores"].keys() == {"match"} and comp["errors"] == {}
    assert [(s, f) for s, _, f in rec.ckpts] == [(2, False), (4, True)]
    assert not result.stopped and result.final_step == 4
    assert result.final_checkpoint == latest_checkpoint(spec.output_dir) == rec.ckpts[-1][1]
    assert result.metrics == last


def test_single_minibatch_is_on_policy(tiny_model_dir, tmp_path):
    """One update per rollout: the ratio is exactly 1 (no clipping), so the step is plain policy
    gradient, and the trainer's recomputed logprobs equal the sampler's."""
    rec = Recorder()
    train(toy_spec(tiny_model_dir, tmp_path, steps=2, mini_batches=1, logprob_gap_every=1), rec)
    for _, m in rec.steps:
        assert m["ratio/mean"] == pytest.approx(1.0, abs=1e-5)
        assert m["ratio/min"] == pytest.approx(1.0, abs=1e-5) and m["ratio/max"] == pytest.approx(1.0, abs=1e-5)
        assert m["clip/low_frac"] == 0 and m["clip/high_frac"] == 0
        assert m["logprob_gap/max"] < 1e-4


def test_later_minibatches_go_off_policy(tiny_model_dir, tmp_path):
    rec = Recorder()
    train(toy_spec(tiny_model_dir, tmp_path, steps=2, mini_batches=4, learning_rate=1e-2), rec)
    m = rec.steps[-1][1]
    assert m["ratio/min"] < 1.0 - 1e-4 or m["ratio/max"] > 1.0 + 1e-4
    assert m["clip/low_frac"] + m["clip/high_frac"] > 0


def test_rollout_logprobs_mode_still_reports_the_gap(tiny_model_dir, tmp_path):
    rec = Recorder()
    train(toy_spec(tiny_model_dir, tmp_path, steps=2, old_logprobs="rollout", mini_batches=2), rec)
    for _, m in rec.steps:
        assert 0.0 <= m["logprob_gap/mean"] <= m["logprob_gap/max"] < 1e-4


@pytest.mark.parametrize("loss", LOSSES.names())
def test_every_registered_loss_updates_the_policy(tiny_model_dir, tmp_path, loss):
    from safetensors.torch import load_file

    result = train(toy_spec(tiny_model_dir, tmp_path, steps=1, loss=loss, learning_rate=1e-2), Recorder())
    before = load_file(Path(tiny_model_dir) / "model.safetensors")
    after = load_file(Path(result.final_checkpoint) / "model" / "model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and all(torch.isfinite(after[k]).all() for k in after)


def test_should_stop_saves_and_returns_stopped(tiny_model_dir, tmp_path):
    rec = Recorder(stop_after=1)
    result = train(toy_spec(tiny_model_dir, tmp_path, steps=3), rec)
    assert result.stopped and result.final_step == 1 and [s for s, _ in rec.steps] == [1]
    assert rec.ckpts == [(1, result.final_checkpoint, False)]
    assert Path(result.final_checkpoint).name == "step-000001" and rec.polls == 2


def test_stop_after_a_saved_step_does_not_save_it_again(tiny_model_dir, tmp_path):
    rec = Recorder(stop_after=2)
    result = train(toy_spec(tiny_model_dir, tmp_path, steps=4, save_every=2), rec)
    assert result.stopped and [(s, f) for s, _, f in rec.ckpts] == [(2, False)]
    assert result.final_checkpoint == rec.ckpts[0][1]


def test_bad_inputs_fail_before_training_naming_the_problem(tiny_model_dir, tmp_path):
    spec = toy_spec(tiny_model_dir, tmp_path)
    with pytest.raises(KeyError, match="unknown loss 'ppo'"):
        train(spec.model_copy(update={"hyperparameters": spec.hyperparameters.model_copy(update={"loss": "ppo"})}))
    with pytest.raises(RewardSpecError) as exc:
        train(spec.model_copy(update={"reward": {**spec.reward, "evaluation_metric": "nope"}}))
    assert exc.value.field == "evaluation_metric"
    with pytest.raises(DataError, match="not found"):
        train(spec.model_copy(update={"training_file": str(tmp_path / "missing.jsonl")}))
    with pytest.raises(OSError, match="cannot load model"):
        train(spec.model_copy(update={"model": str(tmp_path / "no-model")}))
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_warmup_then_cosine_schedule():
    lin = torch.nn.Linear(2, 2)
    cfg = GSPOConfig(
        steps=4,
        prompts_per_step=2,
        group_size=2,
        mini_batches=2,
        learning_rate=1.0,
        warmup_steps=1,
        lr_schedule="cosine",
    )
    opt, sched = make_optimizer(lin, cfg)
    lrs = []
    for _ in range(cfg.steps * cfg.mini_batches):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    import math

    cosine = [0.5 * (1 + math.cos(math.pi * k / 6)) for k in range(6)]
    assert lrs == pytest.approx([0.5, 1.0, *cosine])
    opt, sched = make_optimizer(lin, cfg.model_copy(update={"lr_schedule": "constant", "warmup_steps": 0}))
    assert opt.param_groups[0]["lr"] == 1.0


def test_batches_cover_every_row_once_per_epoch_and_are_reproducible():
    seen = [i for step in range(1, 5) for i in batch_indices(10, step, 5, seed=3, shuffle=True)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # a new order each epoch
    assert batch_indices(10, 2, 5, seed=3, shuffle=True) == seen[5:10]
    assert batch_indices(10, 3, 4, seed=0, shuffle=False) == [8, 9, 0, 1]


def test_lora_with_gradient_checkpointing_trains_the_adapter(tiny_model_dir, tmp_path):
    rec = Recorder()
    spec = toy_spec(tiny_model_dir, tmp_path, steps=1, lora_rank=4, gradient_checkpointing=True, learning_rate=1e-2)
    result = train(spec, rec)
    dcp_to_torch_save(Path(result.final_checkpoint) / "trainer", tmp_path / "trainer.pt")
    trained = torch.load(tmp_path / "trainer.pt", weights_only=False)["model"]  # the trainable tensors
    lora_b = [v for k, v in trained.items() if "lora_B" in k]
    assert lora_b and any(v.abs().max() > 0 for v in lora_b)  # B starts at zero: it moved
    assert all("lora_" in k for k in trained)  # only the adapter is trained
    assert rec.steps[0][1]["grad_norm"] > 0
