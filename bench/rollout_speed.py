"""Rollout tokens/s of the vLLM engine vs the transformers engine, and the weight-push time.

``python -m bench.rollout_speed [--shape small] [--prompts 32] [--group 8] [--tokens 32] [--prompt-tokens 0]``: the same
prompts, fixed-length completions (EOS ignored, seeded as the trainer samples), one warm-up call per
engine, then ``--reps`` calls per engine, the engines taking turns (A B A B ...) in one process.
``measure_rollout`` is the same as a function (bench/run.py may import it). The load average is
reported because on a shared CPU machine it moves the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.gemm_bound import gemm_bound
from bench.workload import instructions
from gspo_core.config import GSPOConfig
from gspo_core.platform import RuntimeOptions, prepare_process
from gspo_core.platform.cpu import CPU_KV_BLOCK
from gspo_core.policy import export_weights, load_policy
from gspo_core.rollout import SamplingSpec, make_engine, vllm_available
from gspo_core.toy import build_tiny_model


def _alternated_seconds(
    engines: dict, prompts: list[list[int]], spec: SamplingSpec, reps: int
) -> tuple[dict[str, int], dict[str, list[float]]]:
    """Completion tokens of one call and seconds of ``reps`` calls, per engine; the engines take turns
    call by call (A B A B ...), so the machine's drift (+-20 % within minutes on some of these VMs)
    falls on both alike."""
    # Warm-up (first-call allocations, kernel selection), which also counts the tokens of a call.
    n_tokens = {
        kind: sum(len(c.completion_ids) for g in eng.generate(prompts, spec) for c in g)
        for kind, eng in engines.items()
    }
    times: dict[str, list[float]] = {kind: [] for kind in engines}
    for _ in range(reps):
        for kind, eng in engines.items():
            t0 = time.perf_counter()
            eng.generate(prompts, spec)
            times[kind].append(time.perf_counter() - t0)
    return n_tokens, times


def _push_seconds(engine, policy, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        engine.load_weights(export_weights(policy))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_rollout(
    shape: str = "small",
    prompts: int = 32,
    group: int = 8,
    tokens: int = 32,
    reps: int = 3,
    engines: tuple[str, ...] = ("transformers", "vllm"),
    model_dir: str | None = None,
    prompt_tokens: int = 0,
    dtype: str = "float32",
) -> dict:
    """Tokens/s of each engine in ``engines`` (and the vLLM weight-push seconds) on ``shape``'s model.

    Returns ``{"<engine>_tokens_per_s": float, "<engine>_tokens_per_s_with_logprobs": float,
    "weight_push_s": float, "vllm_over_transformers": float, "vllm_over_transformers_with_logprobs": float,
    "vllm_over_transformers_per_pair"(_with_logprobs): [float], "gemm_bound_tokens_per_s": float,
    "gemm_bound_block_shared_tokens_per_s": float, "<engine>_share_of_gemm_bound"(_with_logprobs): float,
    "gemm_bound(_block_shared)_over_transformers"(_with_logprobs): float, "vllm_kv_block": int,
    "loadavg_1m_before"/"_after": float, ...}`` (keys present for the engines measured; the bounds:
    :mod:`bench.gemm_bound`; vLLM's KV block, which the block-shared bound counts by). Tokens/s are
    medians over ``reps`` calls; the engines alternate call by call, and each ratio is the median of the
    per-pair ratios.
    The caller owns the process and prepares it (:func:`main` does, with `gspo_core.platform.prepare_process`:
    the heap policy of a training job's process, :mod:`gspo_core.platform.heap`, unless asked otherwise).
    ``prompt_tokens``: every prompt opens with this many tokens of instructions (the short prompts
    alone are 17-18 tokens: with 32-token KV blocks the samples of a prompt share none of its KV, with the
    16-token blocks vLLM gets for completions of at most 64 tokens on CPU, its first 16 tokens).
    ``dtype``: both engines' precision, as a trainer of that precision builds them (``bfloat16``: vLLM's
    weights, the transformers engine's autocast over the fp32 policy).
    """
    model_dir = model_dir or str(
        build_tiny_model(Path(tempfile.gettempdir()) / f"gspo-bench-model-{shape}", shape=shape)
    )
    policy, tok = load_policy(model_dir, GSPOConfig(), torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    prompt_ids = [
        tok(instructions(prompt_tokens) + f"say {chr(97 + i % 5)}: question {i}")["input_ids"] for i in range(prompts)
    ]
    out: dict = {
        "shape": shape,
        "params_m": sum(p.numel() for p in policy.parameters()) / 1e6,
        "prompts": prompts,
        "group": group,
        "tokens": tokens,
        "dtype": dtype,
        "prompt_lengths": [min(map(len, prompt_ids)), max(map(len, prompt_ids))],
        "loadavg_1m_before": os.getloadavg()[0],
    }
    built = {
        kind: make_engine(
            kind,
            model_dir=model_dir,
            policy=policy,
            tokenizer=tok,
            seed=0,
            plain_sampling=True,
            dtype=dtype,
            max_model_len=max(len(p) for p in prompt_ids) + tokens + 16,
            max_num_seqs=prompts * group,
            max_new_tokens=tokens,
        )
        for kind in engines
        if kind != "vllm" or vllm_available()
    }
    try:
        # Without sampler logprobs (old_logprobs=recompute, but for its gap-check steps) and with them
        # (the default old_logprobs=auto and old_logprobs=rollout ask for them at every step).
        for suffix, logprobs in (("", False), ("_with_logprobs", True)):
            spec = SamplingSpec(n=group, max_tokens=tokens, ignore_eos=True, seed=0, logprobs=logprobs)
            n_tokens, times = _alternated_seconds(built, prompt_ids, spec, reps)
            for kind, ts in times.items():
                out[f"{kind}_tokens_per_s{suffix}"] = n_tokens[kind] / statistics.median(ts)
            if {"vllm", "transformers"} <= set(times):
                speed = {k: [n_tokens[k] / t for t in ts] for k, ts in times.items()}
                pairs = [v / h for v, h in zip(speed["vllm"], speed["transformers"], strict=True)]
                out[f"vllm_over_transformers_per_pair{suffix}"] = pairs
                out[f"vllm_over_transformers{suffix}"] = statistics.median(pairs)
        for eng in built.values():
            if not eng.shares_weights:
                out["weight_push_s"] = _push_seconds(eng, policy, reps)
    finally:
        for eng in built.values():
            eng.close()
    # vLLM's KV block: the engine's own on CPU, vLLM's default (16) on a GPU.
    on_cpu = next(policy.parameters()).device.type == "cpu"
    out["vllm_kv_block"] = (getattr(built.get("vllm"), "kv_block", None) or CPU_KV_BLOCK) if on_cpu else 16
    out.update(_against_gemm_bound(out, policy, prompt_ids, group, tokens, dtype, out["vllm_kv_block"]))
    out["loadavg_1m_after"] = os.getloadavg()[0]
    return out


def _against_gemm_bound(
    out: dict, policy, prompt_ids: list[list[int]], group: int, tokens: int, dtype: str, block: int
) -> dict:
    """:func:`bench.gemm_bound.gemm_bound` of this rollout, each engine's tokens/s as a share of it, and
    the bounds over the transformers engine's tokens/s: the most any engine could gain over that one here,
    and the most one could that shares prompts between samples only by whole ``block``-token KV blocks, as
    vLLM does."""
    bound = gemm_bound(policy, [len(p) for p in prompt_ids], group, tokens, getattr(torch, dtype), kv_block=block)
    top = bound["gemm_bound_tokens_per_s"]
    for key in [k for k in out if "_tokens_per_s" in k]:
        bound[key.replace("_tokens_per_s", "_share_of_gemm_bound")] = out[key] / top
    for suffix in ("", "_with_logprobs"):
        if f"transformers_tokens_per_s{suffix}" in out:
            hf = out[f"transformers_tokens_per_s{suffix}"]
            bound[f"gemm_bound_over_transformers{suffix}"] = top / hf
            bound[f"gemm_bound_block_shared_over_transformers{suffix}"] = (
                bound["gemm_bound_block_shared_tokens_per_s"] / hf
            )
    return bound


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rollout_speed")
    ap.add_argument("--shape", default="small", choices=["toy", "small"])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="tokens of instructions opening every prompt")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="both engines' precision (a bf16 trainer samples in bf16)",
    )
    ap.add_argument("--engines", default="transformers,vllm", help="comma-separated: transformers, vllm")
    ap.add_argument(
        "--return-freed-memory",
        action="store_true",
        help="leave glibc's default heap policy (a job's process keeps freed memory: gspo_core.platform.heap)",
    )
    a = ap.parse_args(argv)
    # This command owns its process: it prepares it as a job's process is.
    applied = prepare_process(RuntimeOptions(keep_freed_memory=not a.return_freed_memory))
    out = measure_rollout(
        a.shape,
        a.prompts,
        a.group,
        a.tokens,
        a.reps,
        tuple(a.engines.split(",")),
        prompt_tokens=a.prompt_tokens,
        dtype=a.dtype,
    )
    out["keep_freed_memory"] = "keep_freed_memory" in applied
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
