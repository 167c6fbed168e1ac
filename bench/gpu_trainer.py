"""GPU trainer-side benchmark (any CUDA box, no vLLM needed): a 0.5B-shaped Qwen2 model, random init.

Measures, with gspo_core's own code paths: the old-logprob no-grad forward over a rollout batch,
the GSPO mini-batch update (bf16 autocast, AdamW) and its MFU, transformers-engine rollout tokens/s,
padding waste of right-padded mini-batches vs length-bucketed ones, and peak GPU memory.
``python -m bench.gpu_trainer [--out results.json]``
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from gspo_core import losses as _losses  # noqa: F401  (registers)
from gspo_core.policy import completion_logprobs, pack
from gspo_core.registry import LOSSES

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def make_model(device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(device)


def rollout_batch(n: int, prompt: int, lengths: list[int], vocab: int):
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(n)]
    comps = [[rng.randrange(vocab) for _ in range(lengths[i])] for i in range(n)]
    return prompts, comps


def timed(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--completion", type=int, default=512)
    a = ap.parse_args()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), 989.0)
    model = make_model(dev)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    res: dict = {"device": name, "params": params, "n_seqs": a.n, "prompt_tokens": a.prompt,
                 "completion_tokens": a.completion}
    prompts, comps = rollout_batch(a.n, a.prompt, [a.completion] * a.n, vocab)
    amp = torch.bfloat16

    def old_forward():
        with torch.inference_mode():
            for k in range(0, a.n, 16):
                completion_logprobs(model, pack(prompts[k:k + 16], comps[k:k + 16], 0).to(dev), 1.0, amp)

    t = timed(old_forward)
    toks = a.n * (a.prompt + a.completion)
    res["old_logprobs_s"] = t
    res["old_logprobs_mfu"] = 2 * params * toks / t / (peak * 1e12)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    old = torch.zeros(16, a.completion, device=dev)
    adv = torch.randn(16, device=dev)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False

    def update():
        for k in range(0, a.n, 16):
            batch = pack(prompts[k:k + 16], comps[k:k + 16], 0).to(dev)
            logp = completion_logprobs(model, batch, 1.0, amp)
            loss, _ = LOSSES.get("gspo")(logp, old, adv, batch.mask_BT, 3e-4, 4e-4)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

    torch.cuda.reset_peak_memory_stats()
    t = timed(update, reps=2)
    # 6*N*tokens for forward+backward, +2*N*tokens for the recomputed forward (gradient checkpointing)
    res["update_4_minibatches_s"] = t
    res["update_mfu"] = 8 * params * toks / t / (peak * 1e12)
    res["update_tokens_per_s"] = toks / t
    res["peak_gpu_mem_gib_update"] = torch.cuda.max_memory_allocated() / 2**30

    rng = random.Random(1)
    lengths = [rng.randint(16, a.completion) for _ in range(a.n)]
    padded = sum(max(lengths[k:k + 16]) * 16 for k in range(0, a.n, 16))
    by_len = sorted(lengths)
    bucketed = sum(max(by_len[k:k + 16]) * 16 for k in range(0, a.n, 16))
    res["padding_waste_random_order"] = 1 - sum(lengths) / padded
    res["padding_waste_length_bucketed"] = 1 - sum(lengths) / bucketed

    model.gradient_checkpointing_disable()
    model.config.use_cache = True
    model.eval()
    inp = torch.tensor(prompts[:a.n], device=dev)
    gen_tokens = 128

    def generate():
        with torch.inference_mode(), torch.autocast("cuda", dtype=amp):
            model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), do_sample=True, max_new_tokens=gen_tokens,
                           min_new_tokens=gen_tokens, pad_token_id=0)

    t = timed(generate, reps=1)
    res["hf_generate_tokens_per_s"] = a.n * gen_tokens / t
    res["peak_gpu_mem_gib_total"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(res, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
