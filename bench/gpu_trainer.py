"""GPU trainer-side benchmark (any CUDA box, no vLLM needed): a 0.5B-shaped Qwen2 model, random init.

Runs gspo_core's own trainer code (``gspo_core.step.old_logprobs`` / ``update``, the transformers
rollout engine) and measures: the old-logprob no-grad forward, the 4-mini-batch GSPO update and its
MFU (bf16 autocast over fp32 master weights, as the trainer does on GPU), the update's mini-batch
layout on completions of random length (random-order padding as the trainer does now, length
buckets, packing into one row with per-sequence attention through sdpa or flex attention), the
transformers engine's rollout tokens/s (fp32, as the trainer runs it now, and under bf16 autocast),
and peak GPU memory of each. ``python -m bench.gpu_trainer [--out results.json] [--tiny]`` (``--tiny``:
a small model on the CPU, to check the script itself without a GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
import traceback

import torch

from bench.workload import QWEN_SHAPES
from gspo_core import step as S
from gspo_core.config import GSPOConfig
from gspo_core.packing import pack
from gspo_core.policy import base_model, completion_logprobs
from gspo_core.registry import LOSSES
from gspo_core.rollout.base import Completion

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, datasheet


class Env:
    """Device, timing and FLOP bookkeeping of one benchmark run."""

    def __init__(self, device: torch.device, model) -> None:
        self.device, self.model = device, model
        self.cuda = device.type == "cuda"
        name = torch.cuda.get_device_name() if self.cuda else "cpu"
        self.peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), 989.0) * 1e12
        self.name = name
        self.params = sum(p.numel() for p in model.parameters())
        self.head_params = model.config.vocab_size * model.config.hidden_size
        self.body_params = self.params - self.head_params  # tied embeddings: the head is the embedding

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn, reps: int = 3) -> float:
        """Median wall time of ``reps`` calls after one warm-up call."""
        fn()
        times = []
        for _ in range(reps):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def fwd_flops(self, ro: S.Rollout) -> float:
        """Forward FLOPs: the body on every token, the LM head on completion tokens only (attention
        score FLOPs left out: under 10 % at these lengths)."""
        all_tok = sum(len(c.prompt_ids) + len(c.completion_ids) for c in ro.completions)
        comp_tok = sum(len(c.completion_ids) for c in ro.completions)
        return 2 * self.body_params * all_tok + 2 * self.head_params * comp_tok

    def mem_reset(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def mem_peak_gib(self) -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if self.cuda else 0.0


def make_model(shape: str, device: torch.device, attn: str = "sdpa"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        **QWEN_SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True, attn_implementation=attn
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    return model.float().train()


def make_rollout(prompts: int, group: int, prompt_len: int, lengths: list[int], vocab: int) -> S.Rollout:
    """A rollout batch of random tokens: ``prompts * group`` completions of the given lengths."""
    rng = random.Random(0)
    comps = []
    for p in range(prompts):
        ids = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for g in range(group):
            n = lengths[p * group + g]
            comps.append(
                Completion(
                    prompt_index=p,
                    prompt_ids=ids,
                    completion_ids=[rng.randrange(3, vocab) for _ in range(n)],
                    logprobs=[-10.0] * n,
                    text="",
                    finish_reason="length",
                )
            )
    return S.Rollout(rows=[{}] * prompts, prompts=[""] * prompts, completions=comps)


def cfg_for(ro: S.Rollout, group: int) -> GSPOConfig:
    return GSPOConfig(
        prompts_per_step=len(ro.completions) // group,
        group_size=group,
        mini_batches=4,
        learning_rate=1e-6,
        max_new_tokens=max(len(c.completion_ids) for c in ro.completions),
    )


def _policy(env: Env, amp) -> S.PolicyState:
    opt = torch.optim.AdamW(env.model.parameters(), lr=1e-6, betas=(0.9, 0.99))
    return S.PolicyState(env.model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), amp, pad_id=0)


def bench_old_logprobs(env: Env, ro: S.Rollout, cfg: GSPOConfig, amp) -> dict:
    """The trainer's recompute pass over the whole rollout (the trainer itself skips the first
    mini-batch's rows, whose old logprobs come from the update's first forward: here a plan whose first
    mini-batch is empty)."""
    rows_N = torch.arange(len(ro.completions))
    plan = S.MinibatchPlan(batches=(rows_N[:0], rows_N), live=(rows_N[:0], rows_N))
    policy = _policy(env, amp)
    env.mem_reset()
    t = env.timed(lambda: S.recompute_old_logprobs(policy, ro, plan, cfg))
    return {"s": t, "mfu": env.fwd_flops(ro) / t / env.peak, "peak_gib": env.mem_peak_gib()}


def bench_update(env: Env, ro: S.Rollout, cfg: GSPOConfig, amp, checkpointing: bool) -> dict:
    """``gspo_core.step.update``: 4 mini-batch GSPO updates (fwd + bwd + clip + AdamW) as the trainer runs them,
    on random rewards and the recomputed old logprobs (the sampler's, where that forward fails)."""
    policy = _policy(env, amp)
    adv_N, _ = S.advantages(torch.rand(len(ro.completions), generator=torch.Generator().manual_seed(0)), cfg)
    plan = S.plan_minibatches(ro, adv_N, cfg, torch.Generator().manual_seed(0))
    try:
        old = S.old_logprobs(policy, ro, plan, cfg, mode="recompute")
    except RuntimeError:  # out of memory: the sampler's logprobs do for timing the update
        old = S.old_logprobs(policy, ro, plan, cfg, mode="rollout")
    if checkpointing:
        env.model.gradient_checkpointing_enable()
    env.mem_reset()
    try:
        t = env.timed(functools.partial(S.update, policy, ro, old, adv_N, plan, cfg), reps=2)
    finally:
        env.model.gradient_checkpointing_disable()
        del policy
    flops = env.fwd_flops(ro) * (4 if checkpointing else 3)  # fwd + 2x bwd (+ recomputed fwd)
    tokens = sum(len(c.prompt_ids) + len(c.completion_ids) for c in ro.completions)
    return {
        "s": t,
        "mfu_model_flops": env.fwd_flops(ro) * 3 / t / env.peak,
        "mfu_hardware_flops": flops / t / env.peak,
        "tokens_per_s": tokens / t,
        "peak_gib": env.mem_peak_gib(),
    }


def packed_logprobs(model, comps: list[Completion], device, amp) -> tuple[torch.Tensor, torch.Tensor]:
    """Completion logprobs ``[B, T]`` (and mask) with all sequences packed into ONE row, no padding:
    ``position_ids`` restart at 0 per sequence and no attention mask is passed, so transformers
    builds a per-sequence (block-diagonal causal) mask."""
    ids, pos, where, targets = [], [], [], []
    for c in comps:
        seq, off = c.prompt_ids + c.completion_ids, len(ids)
        ids += seq
        pos += range(len(seq))
        where.append(torch.arange(off + len(c.prompt_ids) - 1, off + len(seq) - 1))
        targets += c.completion_ids
    base = base_model(model)
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        hid_1LH = base.get_decoder()(
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.tensor([pos], device=device),
            use_cache=False,
        ).last_hidden_state
        logits_KV = base.get_output_embeddings()(hid_1LH[0, torch.cat(where).to(device)]).float()
    logp_K = torch.log_softmax(logits_KV, -1).gather(-1, torch.tensor(targets, device=device)[:, None])[:, 0]
    lens = [len(c.completion_ids) for c in comps]
    logp_BT = torch.nn.utils.rnn.pad_sequence(list(logp_K.split(lens)), batch_first=True)
    mask_BT = torch.nn.utils.rnn.pad_sequence([torch.ones(n, device=device) for n in lens], batch_first=True)
    return logp_BT, mask_BT


def _layout_pass(env: Env, ro: S.Rollout, groups: list[list[int]], amp, packed: bool) -> None:
    """Forward + backward of the GSPO loss over mini-batches ``groups`` (no optimizer: layout cost only)."""
    loss_fn = LOSSES.get("gspo")
    for idx in groups:
        comps = [ro.completions[i] for i in idx]
        if packed:
            logp_BT, mask_BT = packed_logprobs(env.model, comps, env.device, amp)
        else:
            batch = pack([c.prompt_ids for c in comps], [c.completion_ids for c in comps], 0).to(env.device)
            logp_BT, mask_BT = completion_logprobs(env.model, batch, 1.0, amp), batch.mask_BT
        loss, _ = loss_fn(
            logp_BT, logp_BT.detach() - 0.01, torch.randn(len(idx), device=env.device), mask_BT, 3e-4, 4e-4
        )
        loss.backward()
    env.model.zero_grad(set_to_none=True)


def bench_layouts(env: Env, ro: S.Rollout, amp) -> dict:
    """Same rollout (random completion lengths), 4 mini-batches, four layouts; plus a packed-vs-padded check."""
    n = len(ro.completions)
    lens = [len(c.completion_ids) for c in ro.completions]
    rand = [t.tolist() for t in torch.randperm(n, generator=torch.Generator().manual_seed(0)).chunk(4)]
    order = sorted(range(n), key=lens.__getitem__)
    buckets = [order[k : k + n // 4] for k in range(0, n, n // 4)]
    real = sum(lens)
    out: dict = {
        "completion_tokens": real,
        "padding_waste_random": 1 - real / sum(max(lens[i] for i in g) * len(g) for g in rand),
        "padding_waste_buckets": 1 - real / sum(max(lens[i] for i in g) * len(g) for g in buckets),
    }
    with torch.no_grad():  # correctness first: packing must give the padded logprobs
        comps = [ro.completions[i] for i in rand[0]]
        a_BT, m_BT = packed_logprobs(env.model, comps, env.device, amp)
        batch = pack([c.prompt_ids for c in comps], [c.completion_ids for c in comps], 0).to(env.device)
        b_BT = completion_logprobs(env.model, batch, 1.0, amp)
        out["packed_vs_padded_max_abs_diff"] = float(((a_BT - b_BT[:, : a_BT.size(1)]).abs() * m_BT).max())
    for name, groups, packed, attn in (
        ("padded_random_order", rand, False, "sdpa"),
        ("padded_length_buckets", buckets, False, "sdpa"),
        ("packed_sdpa", rand, True, "sdpa"),
        ("packed_flex", rand, True, "flex_attention"),
    ):
        try:
            env.model.set_attn_implementation(attn)
            env.mem_reset()
            t = env.timed(functools.partial(_layout_pass, env, ro, groups, amp, packed), reps=2)
            out[name] = {"fwd_bwd_s": t, "peak_gib": env.mem_peak_gib()}
        except Exception as exc:  # one layout failing (e.g. flex on an old torch) must not lose the others
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        finally:
            env.model.set_attn_implementation("sdpa")
    return out


def bench_rollout(env: Env, prompts: int, group: int, prompt_len: int, tokens: int, tok_dir: str) -> dict:
    """Transformers-engine tokens/s: as the trainer runs it (fp32 weights, no autocast), under bf16
    autocast, and bare ``model.generate`` under bf16 autocast (no logprob recording) as a floor."""
    from gspo_core.rollout import SamplingSpec
    from gspo_core.rollout.hf_engine import TransformersEngine
    from gspo_core.toy import build_tokenizer

    tok = build_tokenizer(tok_dir, env.model.config.vocab_size)
    engine = TransformersEngine(env.model, tok, seed=0)
    rng = random.Random(1)
    prompt_ids = [[rng.randrange(3, env.model.config.vocab_size) for _ in range(prompt_len)] for _ in range(prompts)]
    spec = SamplingSpec(n=group, max_tokens=tokens, ignore_eos=True, seed=0)
    n_tok = prompts * group * tokens
    out = {"sequences": prompts * group, "tokens_each": tokens}
    env.mem_reset()
    out["engine_fp32_tokens_per_s"] = n_tok / env.timed(lambda: engine.generate(prompt_ids, spec), reps=1)

    def engine_bf16():
        with torch.autocast(env.device.type, dtype=torch.bfloat16):
            engine.generate(prompt_ids, spec)

    out["engine_bf16_autocast_tokens_per_s"] = n_tok / env.timed(engine_bf16, reps=1)
    inp = torch.tensor([p for p in prompt_ids for _ in range(group)], device=env.device)

    def bare():
        with torch.inference_mode(), torch.autocast(env.device.type, dtype=torch.bfloat16):
            env.model.generate(
                input_ids=inp,
                attention_mask=torch.ones_like(inp),
                do_sample=True,
                top_k=0,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                pad_token_id=0,
            )

    out["bare_generate_bf16_tokens_per_s"] = n_tok / env.timed(bare, reps=1)
    out["peak_gib"] = env.mem_peak_gib()
    env.model.train()
    return out


def _section(res: dict, name: str, fn, out_path: str | None) -> None:
    t0 = time.perf_counter()
    try:
        res[name] = fn()
    except Exception as exc:
        res[name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "trace": traceback.format_exc()[-1500:]}
    res[name]["wall_s"] = time.perf_counter() - t0
    print(name, json.dumps(res[name])[:600], flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_trainer")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU: checks the script, no GPU needed")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--skip", default="", help="comma list of sections to skip")
    a = ap.parse_args(argv)
    device = torch.device("cpu" if a.tiny else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # the trainer does not turn TF32 on: measure what it runs
    model = make_model("qwen-tiny" if a.tiny else "qwen0.5b", device)
    env = Env(device, model)
    amp = torch.bfloat16
    V, G, P = model.config.vocab_size, a.group, a.prompts
    res: dict = {
        "device": env.name,
        "torch": torch.__version__,
        "params": env.params,
        "prompts": P,
        "group": G,
        "prompt_tokens": a.prompt_len,
        "completion_tokens": a.completion,
    }
    fixed = make_rollout(P, G, a.prompt_len, [a.completion] * (P * G), V)
    rng = random.Random(2)
    varied = make_rollout(P, G, a.prompt_len, [rng.randint(16, a.completion) for _ in range(P * G)], V)
    cfg = cfg_for(fixed, G)
    sections = {
        "old_logprobs": lambda: bench_old_logprobs(env, fixed, cfg, amp),
        "update": lambda: bench_update(env, fixed, cfg, amp, checkpointing=False),
        "update_grad_checkpointing": lambda: bench_update(env, fixed, cfg, amp, checkpointing=True),
        "layouts": lambda: bench_layouts(env, varied, amp),
        "rollout": lambda: bench_rollout(env, P, G, a.prompt_len, a.gen_tokens, "/tmp/gspo-gpu-bench-tok"),
    }
    for name, fn in sections.items():
        if name not in a.skip.split(","):
            _section(res, name, fn, a.out)


if __name__ == "__main__":
    main()
