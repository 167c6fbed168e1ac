"""The rollout benchmark: engines take turns call by call, and a real run reports both engines."""

from __future__ import annotations

import pytest

from bench.rollout_speed import _alternated_seconds, measure_rollout
from gspo_core.rollout import Completion, SamplingSpec


class _Recorder:
    """An engine that only records when it was called (the harness's order is what is tested)."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def generate(self, prompts, spec):
        self.calls.append(self.name)
        return [
            [Completion(i, p, [1] * spec.max_tokens, [], "", "length") for _ in range(spec.n)]
            for i, p in enumerate(prompts)
        ]


def test_engines_take_turns_after_one_warm_up_each():
    calls: list[str] = []
    engines = {"a": _Recorder("a", calls), "b": _Recorder("b", calls)}
    n_tokens, times = _alternated_seconds(engines, [[1], [2], [3]], SamplingSpec(n=2, max_tokens=5), reps=3)
    assert calls == ["a", "b"] * 4
    assert n_tokens == {"a": 30, "b": 30} and all(len(t) == 3 for t in times.values())


@pytest.mark.vllm
def test_a_real_run_reports_both_engines_and_the_push(tiny_model_dir):
    pytest.importorskip("vllm")
    out = measure_rollout("toy", prompts=2, group=2, tokens=4, reps=2, model_dir=str(tiny_model_dir))
    for suffix in ("", "_with_logprobs"):
        assert out[f"transformers_tokens_per_s{suffix}"] > 0 and out[f"vllm_tokens_per_s{suffix}"] > 0
        assert len(out[f"vllm_over_transformers_per_pair{suffix}"]) == 2
        assert min(out[f"vllm_over_transformers_per_pair{suffix}"]) <= out[f"vllm_over_transformers{suffix}"]
        # Neither engine outruns the GEMMs it must do (bench/gemm_bound.py).
        assert 0 < out[f"vllm_share_of_gemm_bound{suffix}"] <= 1
        assert 0 < out[f"transformers_share_of_gemm_bound{suffix}"] <= 1
        assert out[f"gemm_bound_over_transformers{suffix}"] >= 1
        assert out[f"gemm_bound_block_shared_over_transformers{suffix}"] > 0
    assert out["weight_push_s"] > 0
    # 4-token completions: the engine's short-completion block, which the block-shared bound counts by
    from gspo_core.platform.cpu import cpu_kv_block

    assert out["vllm_kv_block"] == cpu_kv_block(4, "float32")
