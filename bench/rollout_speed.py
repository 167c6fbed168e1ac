"""Rollout tokens/s of the vLLM engine vs the transformers engine, and the weight-push time.

``python -m bench.rollout_speed [--shape small] [--prompts 32] [--group 8] [--tokens 32]``; the same
prompts, fixed-length completions (EOS ignored), one warm-up call each, then the median of 3.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gspo_core.config import GSPOConfig
from gspo_core.policy import export_weights, load_policy
from gspo_core.rollout import SamplingSpec, make_engine
from gspo_core.toy import build_tiny_model


def tokens_per_s(engine, prompts, spec: SamplingSpec, reps: int = 3) -> float:
    engine.generate(prompts, spec)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        groups = engine.generate(prompts, spec)
        times.append(time.perf_counter() - t0)
    n = sum(len(c.completion_ids) for g in groups for c in g)
    return n / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rollout_speed")
    ap.add_argument("--shape", default="small")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--unseeded", action="store_true", help="no per-request seeds (vLLM n>1 parallel sampling)")
    a = ap.parse_args(argv)
    model_dir = build_tiny_model(Path(tempfile.gettempdir()) / f"gspo-bench-model-{a.shape}", shape=a.shape)
    policy, tok = load_policy(str(model_dir), GSPOConfig(), torch.device("cpu"))
    prompts = [tok(f"say {chr(97 + i % 5)}: question {i}")["input_ids"] for i in range(a.prompts)]
    spec = SamplingSpec(n=a.group, max_tokens=a.tokens, ignore_eos=True, seed=None if a.unseeded else 0)
    out = {"shape": a.shape, "prompts": a.prompts, "group": a.group, "tokens": a.tokens}
    hf = make_engine("transformers", model_dir=str(model_dir), policy=policy, tokenizer=tok, seed=0, max_model_len=512)
    out["transformers_tokens_per_s"] = tokens_per_s(hf, prompts, spec)
    vl = make_engine("vllm", model_dir=str(model_dir), policy=policy, tokenizer=tok, seed=0, max_model_len=512)
    out["vllm_tokens_per_s"] = tokens_per_s(vl, prompts, spec)
    pushes = []
    for _ in range(3):
        t0 = time.perf_counter()
        vl.load_weights(export_weights(policy))
        pushes.append(time.perf_counter() - t0)
    out["weight_push_s"] = statistics.median(pushes)
    out["vllm_over_transformers"] = out["vllm_tokens_per_s"] / out["transformers_tokens_per_s"]
    vl.close()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
