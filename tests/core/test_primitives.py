"""The training and sampling primitives on the toy model: every loss in one forward-backward, optimizer steps,
state, export, sampling, and the GSPO job loop's update as a loop over the primitives."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from gspo_core import step as phases
from gspo_core.datum_losses import LossInputs, config_for
from gspo_core.primitives import AdamParams, Datum, LoraSpec, SamplingParams, SamplingSession, TrainingSession
from gspo_core.primitives.core import PolicyState
from gspo_core.registry import DATUM_LOSSES
from gspo_core.rollout.hf_engine import TransformersEngine
from tests.core.trainer_support import UPDATE_CFG, one_torch_thread, update_step

TINKER_LOSSES = {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"}


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture
def session(tiny_model_dir):
    training = TrainingSession.create(str(tiny_model_dir), seed=0, device="cpu")
    yield training
    training.close()


def _row(tokenizer, prompt: str, answer: str, advantage: float = 1.0) -> Datum:
    """A prompt + answer row: weights, sampler log-probs (-1) and advantages on the answer's positions only."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    full = prompt_ids + answer_ids
    answer_at = [0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer_ids)
    return Datum(
        tokens=full[:-1],
        target_tokens=full[1:],
        weights=answer_at,
        logprobs=[-1.0 * w for w in answer_at],
        advantages=[advantage * w for w in answer_at],
    )


def test_every_sdk_loss_and_ours_is_registered():
    assert TINKER_LOSSES | {"gspo_token"} <= set(DATUM_LOSSES.names())


@pytest.mark.parametrize("loss", sorted(TINKER_LOSSES | {"gspo_token"}))
def test_each_loss_is_one_forward_backward_with_per_position_logprobs(session, loss):
    data = [_row(session.tokenizer, "say a:", "aaaa"), _row(session.tokenizer, "say b:", "bb", advantage=-0.5)]
    on_policy = session.forward(data, "cross_entropy").logprobs  # the sampler's log-probs: the same weights'
    data = [
        replace(d, logprobs=[lp * w for lp, w in zip(row, d.weights or [], strict=True)])
        for d, row in zip(data, on_policy, strict=True)
    ]
    out = session.forward_backward(data, loss)
    assert [len(row) for row in out.logprobs] == [len(d.tokens) for d in data]
    assert all(lp <= 0 for row in out.logprobs for lp in row)
    assert "loss:sum" in out.metrics and out.metrics["loss:sum"] == out.metrics["loss:sum"]  # not NaN
    grads = [p.grad for p in session.policy.params if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)


def test_forward_logprobs_are_the_models_own(session, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    datum = _row(session.tokenizer, "say c:", "ccc")
    out = session.forward([datum], "cross_entropy")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        logp_LV = model(input_ids=torch.tensor([datum.tokens])).logits[0].log_softmax(-1)
    want = logp_LV.gather(-1, torch.tensor(datum.target_tokens).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(out.logprobs[0]), want, atol=1e-5, rtol=1e-5)
    assert all(p.grad is None for p in session.policy.params)  # forward: no gradient


def test_cross_entropy_is_the_weighted_sum_and_training_lowers_it(session):
    datum = _row(session.tokenizer, "say a:", "aaaa")
    out = session.forward([datum], "cross_entropy")
    weighted = -sum(lp * w for lp, w in zip(out.logprobs[0], datum.weights or [], strict=True))
    assert out.metrics["loss:sum"] == pytest.approx(weighted, rel=1e-5)
    losses = []
    for _ in range(5):
        losses.append(session.forward_backward([datum], "cross_entropy").metrics["loss:sum"])
        metrics = session.optim_step(AdamParams(learning_rate=1e-2))
        assert metrics["grad_norm"] > 0
    assert losses[-1] < losses[0] * 0.8
    assert all(p.grad is None for p in session.policy.params)  # optim_step zeroes the gradients


def test_gradients_accumulate_over_calls(session):
    a, b = _row(session.tokenizer, "say a:", "aa"), _row(session.tokenizer, "say b:", "bbb")
    session.forward_backward([a, b], "ppo")
    together = [p.grad.clone() for p in session.policy.params]
    session.policy.optimizer.zero_grad(set_to_none=True)
    session.forward_backward([a], "ppo")
    session.forward_backward([b], "ppo")
    for x, y in zip(together, [p.grad for p in session.policy.params], strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-4)


def _inputs(old, adv, mask=None):
    old_BT, adv_BT = torch.tensor([old]), torch.tensor([adv])
    ones_BT = torch.ones_like(old_BT)
    ratio_mask_BT = torch.tensor([mask]) if mask else (adv_BT != 0).float()
    return LossInputs(ones_BT, ones_BT, old_BT, adv_BT, ratio_mask_BT)


def test_loss_values_and_gradients_follow_their_formulas():
    logp = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
    inputs = _inputs([-1.2, -0.5, -1.0], [1.0, -1.0, 2.0])
    ratio = torch.exp(logp.detach() - inputs.old_BT)
    # importance_sampling: -sum(r A); gradient -r A
    loss, _ = DATUM_LOSSES.get("importance_sampling")(logp, inputs, {})
    assert float(loss.detach()) == pytest.approx(float(-(ratio * inputs.adv_BT).sum()))
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -ratio * inputs.adv_BT)
    # ppo at [0.8, 1.2]: position 0 (r=1.22, A>0) clipped: no gradient; position 2 (r=0.37, A>0) is not
    loss, metrics = DATUM_LOSSES.get("ppo")(logp, inputs, config_for(DATUM_LOSSES.get("ppo"), None))
    (grad,) = torch.autograd.grad(loss, logp)
    assert float(grad[0, 0]) == 0 and float(grad[0, 2]) == pytest.approx(float(-ratio[0, 2] * 2))
    assert metrics["clip/high:sum"] == 1
    # cispo: the clipped ratio weighs the log-prob's gradient, nothing dropped
    loss, _ = DATUM_LOSSES.get("cispo")(logp, inputs, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -(ratio.clamp(0.8, 1.2) * inputs.adv_BT))
    # dro: -sum(logp A - beta/2 (logp - q)^2)
    loss, _ = DATUM_LOSSES.get("dro")(logp, inputs, {"beta": 0.1})
    want = -(logp.detach() * inputs.adv_BT - 0.05 * (logp.detach() - inputs.old_BT) ** 2).sum()
    assert float(loss.detach()) == pytest.approx(float(want))
    # stable_reinforce at [0.5, 2]: position 2 (r=0.37) trains nothing
    loss, _ = DATUM_LOSSES.get("stable_reinforce")(
        logp, inputs, {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert float(grad[0, 2]) == 0 and float(grad[0, 0]) == pytest.approx(float(-ratio[0, 0]))


def test_gspo_takes_one_ratio_per_row_over_its_mask():
    logp = torch.tensor([[-1.0, -0.5, -2.0, -3.0]], requires_grad=True)
    inputs = _inputs([0.0, -0.5001, -2.0002, -3.0], [0.0, 1.0, 1.0, 0.0], mask=[0.0, 1.0, 1.0, 0.0])
    wide = {"clip_low_threshold": 0.0, "clip_high_threshold": 10.0}
    loss, metrics = DATUM_LOSSES.get("gspo")(logp, inputs, wide)
    s = float(torch.exp(torch.tensor((0.0001 + 0.0002) / 2)))
    assert float(loss) == pytest.approx(-2 * s, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -s, -s, 0.0]]))
    assert metrics["ratio:min"] == pytest.approx(s) == metrics["ratio:max"]


def test_unknown_loss_config_key_and_missing_inputs_are_named(session):
    datum = _row(session.tokenizer, "say a:", "aa")
    with pytest.raises(ValueError, match=r"loss_config\.beta"):
        session.forward_backward([datum], "ppo", {"beta": 1.0})
    with pytest.raises(ValueError, match=r"^loss: unknown 'nope'"):
        session.forward_backward([datum], "nope")
    bare = Datum(tokens=datum.tokens, target_tokens=datum.target_tokens, logprobs=datum.logprobs)
    with pytest.raises(ValueError, match=r"data\[0\]\.advantages"):
        session.forward_backward([bare], "importance_sampling")
    with pytest.raises(ValueError, match=r"data\[0\]\.target_tokens"):
        session.forward([Datum(tokens=[1, 2, 3], target_tokens=[2, 3], weights=[1, 1, 1])], "cross_entropy")
    with pytest.raises(ValueError, match=r"data\[0\]\.tokens: token ids must lie in \[0, 102\)"):
        session.forward([Datum(tokens=[1, 102], target_tokens=[2, 3], weights=[1, 1])], "cross_entropy")
    nan = replace(datum, advantages=[float("nan")] * len(datum.tokens))
    with pytest.raises(ValueError, match=r"data\[0\]\.advantages: values must be finite"):
        session.forward_backward([nan], "ppo")


def test_state_round_trip_resumes_exactly(session, tmp_path, tiny_model_dir):
    datum = _row(session.tokenizer, "say a:", "aaaa")
    adam = AdamParams(learning_rate=1e-2)
    session.forward_backward([datum], "cross_entropy")
    session.optim_step(adam)
    session.save_state(str(tmp_path / "state"))
    saved_weights = [p.detach().clone() for p in session.policy.params]
    session.forward_backward([datum], "cross_entropy")
    session.optim_step(adam)
    want = [p.detach().clone() for p in session.policy.params]
    other = TrainingSession.create(str(tiny_model_dir), seed=1, device="cpu")
    other.load_state(str(tmp_path / "state"))
    other.forward_backward([datum], "cross_entropy")
    other.optim_step(adam)
    for x, y in zip(want, other.policy.params, strict=True):
        torch.testing.assert_close(x, y.detach(), atol=0, rtol=0)
    # without the optimizer's state the weights alone come back: a fresh AdamW's first step differs
    fresh = TrainingSession.create(str(tiny_model_dir), seed=1, device="cpu")
    fresh.load_state(str(tmp_path / "state"), optimizer=False)
    moments = [s["exp_avg"] for s in fresh.policy.optimizer.state.values()]  # DCP makes zero ones to load into
    assert all(float(m.abs().max()) == 0 for m in moments)
    for x, y in zip(saved_weights, fresh.policy.params, strict=True):
        torch.testing.assert_close(x, y.detach(), atol=0, rtol=0)
    with pytest.raises(FileNotFoundError, match="no saved training state"):
        fresh.load_state(str(tmp_path / "nothing"))


def test_export_loads_in_transformers_with_the_trained_weights(session, tmp_path):
    from transformers import AutoModelForCausalLM

    datum = _row(session.tokenizer, "say a:", "aaaa")
    session.forward_backward([datum], "cross_entropy")
    session.optim_step(AdamParams(learning_rate=1e-2))
    session.export_hf(str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with torch.no_grad():
        logp_LV = loaded(input_ids=torch.tensor([datum.tokens])).logits[0].log_softmax(-1)
    got = logp_LV.gather(-1, torch.tensor(datum.target_tokens).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(
        got, torch.tensor(session.forward([datum], "cross_entropy").logprobs[0]), atol=1e-5, rtol=1e-5
    )


def test_lora_session_trains_only_its_adapter(tiny_model_dir, tmp_path):
    lora = TrainingSession.create(str(tiny_model_dir), lora=LoraSpec(rank=4, alpha=8.0), device="cpu")
    names = [n for n, p in lora.policy.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    datum = _row(lora.tokenizer, "say a:", "aaaa")
    before = lora.forward([datum], "cross_entropy").metrics["loss:sum"]
    for _ in range(3):
        lora.forward_backward([datum], "cross_entropy")
        lora.optim_step(AdamParams(learning_rate=2e-2))
    assert lora.forward([datum], "cross_entropy").metrics["loss:sum"] < before
    lora.export_hf(str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "adapter").is_dir()
    with pytest.raises(ValueError, match=r"lora\.rank"):
        TrainingSession.create(str(tiny_model_dir), lora=LoraSpec(rank=0), device="cpu")


def test_sampling_session_samples_scores_and_takes_the_trainers_weights(session, tiny_model_dir, tmp_path):
    sampler = SamplingSession.create(str(tiny_model_dir), engine="transformers")
    prompt = session.tokenizer("say a:", add_special_tokens=False)["input_ids"]
    seqs = sampler.sample(prompt, 3, SamplingParams(max_tokens=5, seed=0))
    assert len(seqs) == 3 and all(len(s.tokens) == len(s.logprobs) <= 5 for s in seqs)
    assert all(s.stop_reason in ("stop", "length") for s in seqs)
    again = sampler.sample(prompt, 3, SamplingParams(max_tokens=5, seed=0))
    assert [s.tokens for s in again] == [s.tokens for s in seqs]  # a seed fixes the samples
    first = seqs[0].tokens[0]
    cut = sampler.sample(prompt, 3, SamplingParams(max_tokens=5, seed=0, stop=[first]))
    assert cut[0].tokens == [first] and cut[0].stop_reason == "stop"
    text = session.tokenizer.decode(seqs[0].tokens[:2])
    by_text = sampler.sample(prompt, 3, SamplingParams(max_tokens=5, seed=0, stop=[text]))
    assert by_text[0].tokens == seqs[0].tokens[:2] and by_text[0].stop_reason == "stop"
    # sampler log-probs are the trainer's of the same tokens (temperature 1, top_p 1)
    tokens = prompt + seqs[0].tokens
    scored = sampler.compute_logprobs(tokens)
    assert scored[0] is None
    torch.testing.assert_close(torch.tensor(scored[len(prompt) :]), torch.tensor(seqs[0].logprobs), atol=1e-5, rtol=0)
    # after a training step, take_weights makes the sampler score by the new weights
    datum = Datum(tokens=tokens[:-1], target_tokens=tokens[1:], weights=[1.0] * (len(tokens) - 1))
    session.export_hf(str(tmp_path / "before"))
    session.forward_backward([datum], "cross_entropy")
    session.optim_step(AdamParams(learning_rate=5e-2))
    trained = session.forward([datum], "cross_entropy").logprobs[0]
    assert sampler.compute_logprobs(tokens)[1:] != pytest.approx(trained, abs=1e-4)
    sampler.take_weights(session)
    torch.testing.assert_close(
        torch.tensor(sampler.compute_logprobs(tokens)[1:]), torch.tensor(trained), atol=1e-5, rtol=0
    )
    # load_weights: an export's weights back into the same engine (an older sampler's, in a session worker)
    sampler.load_weights(str(tmp_path / "before"))
    torch.testing.assert_close(
        torch.tensor(sampler.compute_logprobs(tokens)[1:]), torch.tensor(scored[1:]), atol=1e-5, rtol=0
    )
    sampler.close()


def test_a_sampling_session_over_the_job_loops_transformers_engine_scores_with_its_model(session):
    """The job loop wraps the trainer's own engine (no model copy of the session's): compute_logprobs uses the
    engine's model, not vLLM's path."""
    engine = TransformersEngine(session.policy.model, session.tokenizer)
    sampler = SamplingSession(engine, session.tokenizer)
    tokens = session.tokenizer("say a: a b", add_special_tokens=False)["input_ids"]
    datum = Datum(tokens=tokens[:-1], target_tokens=tokens[1:], weights=[1.0] * (len(tokens) - 1))
    torch.testing.assert_close(
        torch.tensor(sampler.compute_logprobs(tokens)[1:]),
        torch.tensor(session.forward([datum], "cross_entropy").logprobs[0]),
        atol=1e-5,
        rtol=0,
    )


def test_ignore_eos_samples_max_tokens_past_the_end_of_sequence(tiny_model_dir):
    """Without ``ignore_eos`` some of these samples end at EOS; with it every one runs to ``max_tokens`` (the
    fixed-length work a benchmark compares), its log-probs still one per token."""
    sampler = SamplingSession.create(str(tiny_model_dir), engine="transformers")
    try:
        prompt = sampler.tokenizer("say a:", add_special_tokens=False)["input_ids"]
        free = sampler.sample(prompt, 16, SamplingParams(max_tokens=48, seed=0))
        assert any(s.stop_reason == "stop" and len(s.tokens) < 48 for s in free)  # the case under test occurs
        fixed = sampler.sample(prompt, 16, SamplingParams(max_tokens=48, seed=0, ignore_eos=True))
        assert all(len(s.tokens) == len(s.logprobs) == 48 and s.stop_reason == "length" for s in fixed)
    finally:
        sampler.close()


def test_sample_many_samples_every_prompts_group_in_one_engine_call(tiny_model_dir):
    """Many prompts' groups in one call of the engine (the batching a loop of one call per prompt loses), each
    group sampled from its own prompt; an empty prompt is refused by its index."""
    sampler = SamplingSession.create(str(tiny_model_dir), engine="transformers")
    calls = []
    generate = sampler.engine.generate

    def counted(prompt_ids, spec):
        calls.append(len(prompt_ids))
        return generate(prompt_ids, spec)

    sampler.engine.generate = counted  # the real engine, its calls counted
    try:
        prompts = [sampler.tokenizer(f"say {c}:", add_special_tokens=False)["input_ids"] for c in "abc"]
        groups = sampler.sample_many(prompts, 2, SamplingParams(max_tokens=6, seed=0, ignore_eos=True))
        assert calls == [3]
        assert [len(g) for g in groups] == [2, 2, 2]
        assert all(len(s.tokens) == len(s.logprobs) == 6 for g in groups for s in g)
        # each group's log-probs are its own prompt's: rescoring prompt + tokens gives them back
        for prompt, group in zip(prompts, groups, strict=True):
            scored = sampler.compute_logprobs(prompt + group[0].tokens)[len(prompt) :]
            torch.testing.assert_close(torch.tensor(scored), torch.tensor(group[0].logprobs), atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match=r"^prompts\[1\]: empty"):
            sampler.sample_many([prompts[0], []], 2, SamplingParams(max_tokens=3))
    finally:
        sampler.close()


def _datums(completions, rows, old_NT, adv_N, n_rows):
    """The job loop's rows as Datums: completion positions carry the old log-probs and the advantage as a share
    of the mini-batch's mean (the job loop's loss is a mean over the mini-batch's ``n_rows`` rows)."""
    data = []
    for i in rows.tolist():
        c = completions[i]
        full, start = c.prompt_ids + c.completion_ids, len(c.prompt_ids) - 1
        sampled = [float(m) for m in (c.trained_mask or [1] * len(c.completion_ids))]
        pad = [0.0] * start
        old = [float(x) for x in old_NT[i, : len(c.completion_ids)]]
        adv = float(adv_N[i]) / n_rows
        data.append(
            Datum(
                tokens=full[:-1],
                target_tokens=full[1:],
                logprobs=pad + old,
                advantages=pad + [adv * m for m in sampled],
                mask=pad + sampled,
            )
        )
    return data


def test_gspo_through_the_primitives_is_the_job_loops_update(sampled):
    """The job loop's GSPO step (4 mini-batches, recomputed old log-probs) and the same step written as a
    cookbook-style loop of forward / forward_backward / optim_step: the same gradients, the same weights. AdamW
    steps the same weights for gradients off by any one factor (it divides by their scale), so the gradients'
    norms before clipping are compared too."""
    cfg = UPDATE_CFG.model_copy(update={"old_logprobs": "recompute", "loss": "gspo"})
    _, job_metrics, job_model = update_step(sampled, cfg)
    model0, pad_id, completions, rewards_N = sampled
    model = copy.deepcopy(model0)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.0)
    session = TrainingSession(
        PolicyState(model, optimizer, None, None, pad_id), tokenizer=None, micro_batch_tokens=10**6
    )
    adv_N, _ = phases.advantages(rewards_N, cfg)
    rollout = phases.Rollout(rows=[{}] * 4, prompts=[""] * 4, completions=completions)
    plan = phases.plan_minibatches(rollout, adv_N, cfg, torch.Generator().manual_seed(1))
    # the old policy's log-probs: one forward of every row before any step
    every = torch.arange(len(completions))
    scored = session.forward(_datums(completions, every, torch.zeros(len(completions), 8), adv_N, 1), "gspo_token")
    old_NT = torch.zeros(len(completions), max(len(c.completion_ids) for c in completions))
    for i, (c, row) in enumerate(zip(completions, scored.logprobs, strict=True)):
        old_NT[i, : len(c.completion_ids)] = torch.tensor(row[len(c.prompt_ids) - 1 :])
    adam = AdamParams(
        learning_rate=cfg.learning_rate,
        beta1=cfg.adam_beta1,
        beta2=cfg.adam_beta2,
        eps=1e-8,
        weight_decay=cfg.weight_decay,
        grad_clip_norm=cfg.max_grad_norm,
    )
    bounds = {"clip_low_threshold": 1 - cfg.clip_eps_low, "clip_high_threshold": 1 + cfg.clip_eps_high}
    grad_norms = []
    for rows in plan.batches:
        session.forward_backward(_datums(completions, rows, old_NT, adv_N, len(rows)), "gspo_token", bounds)
        grad_norms.append(session.optim_step(adam)["grad_norm"])
    assert sum(grad_norms) / len(grad_norms) == pytest.approx(job_metrics["grad_norm"], rel=1e-4)
    for (name, a), b in zip(job_model.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=0.02 * cfg.learning_rate, rtol=0, msg=name)
    moved = max(float((a - b).abs().max()) for a, b in zip(model0.parameters(), model.parameters(), strict=True))
    assert moved > 0.5 * cfg.learning_rate  # the step trained


@pytest.mark.slow
def test_two_ranks_follow_rank_zero_to_the_weights_of_one(tiny_model_dir, tmp_path):
    """Rank 1 runs rank 0's calls (FSDP2 over gloo, each rank its share of the rows): the same losses, log-probs
    and exported weights as one process."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from tests.core.primitives_ranks import loop
    from tests.core.trainer_support import THREAD_ENV

    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    loop(TrainingSession.create(str(tiny_model_dir), device="cpu"), tmp_path / "one")
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "tests.core.primitives_ranks", str(tiny_model_dir), str(tmp_path / "two")]
    env = {**os.environ, **THREAD_ENV, "PYTHONPATH": str(root)}
    run = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = (json.loads((tmp_path / d / "result.json").read_text()) for d in ("one", "two"))
    for a, b in zip(one["metrics"], two["metrics"], strict=True):
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6) for k in a), (a, b)
    for a, b in zip(one["logprobs"], two["logprobs"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    want, got = (load_file(str(tmp_path / d / "hf" / "model.safetensors")) for d in ("one", "two"))
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(want[name], got[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.vllm
def test_vllm_sampling_session_scores_as_the_trainer_and_takes_its_weights(session, tiny_model_dir, tmp_path):
    pytest.importorskip("vllm")
    sampler = SamplingSession.create(str(tiny_model_dir), engine="vllm", max_model_len=64)
    try:
        prompt = session.tokenizer("say a:", add_special_tokens=False)["input_ids"]
        seqs = sampler.sample(prompt, 2, SamplingParams(max_tokens=5, seed=0))
        assert len(seqs) == 2 and all(len(s.tokens) == len(s.logprobs) >= 1 for s in seqs)
        tokens = prompt + seqs[0].tokens
        datum = Datum(tokens=tokens[:-1], target_tokens=tokens[1:], weights=[1.0] * (len(tokens) - 1))
        trainer_logprobs = session.forward([datum], "cross_entropy").logprobs[0]
        scored = sampler.compute_logprobs(tokens)
        assert scored[0] is None
        torch.testing.assert_close(torch.tensor(scored[1:]), torch.tensor(trainer_logprobs), atol=1e-4, rtol=0)
        torch.testing.assert_close(
            torch.tensor(seqs[0].logprobs), torch.tensor(trainer_logprobs[len(prompt) - 1 :]), atol=1e-4, rtol=0
        )
        session.export_hf(str(tmp_path / "before"))
        session.forward_backward([datum], "cross_entropy")
        session.optim_step(AdamParams(learning_rate=5e-2))
        trained = session.forward([datum], "cross_entropy").logprobs[0]
        sampler.take_weights(session)  # the push: vLLM's weight-transfer API, no disk
        torch.testing.assert_close(
            torch.tensor(sampler.compute_logprobs(tokens)[1:]), torch.tensor(trained), atol=1e-4, rtol=0
        )
        sampler.load_weights(str(tmp_path / "before"))  # an export back into the same engine
        torch.testing.assert_close(
            torch.tensor(sampler.compute_logprobs(tokens)[1:]), torch.tensor(scored[1:]), atol=1e-4, rtol=0
        )
    finally:
        sampler.close()
