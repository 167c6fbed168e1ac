"""The platform seam: the platform chosen on this CPU, what it prepares in its process (only when the process
owner asks), the vLLM arguments it gives, and the operator's runtime options."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_core.platform import Platform, RuntimeOptions, current, prepare_job
from gspo_core.platform.cpu import CPU_KV_BLOCK, CPU_SHORT_KV_BLOCK, CpuPlatform, cpu_kv_cache, cpu_shares
from gspo_core.platform.cpu_attention import runs_16_token_blocks
from gspo_core.rollout import vllm_available

ROOT = Path(__file__).resolve().parents[2]
X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_the_default_platform_here_is_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU machine gets the accelerator platform")
    assert isinstance(current(), CpuPlatform) and current().name == "cpu" and current() is current()


# Prints what prepare_process applied and the multiprocessing switch it left (tests/core/test_memory.py
# measures what the heap policy does).
_PROBE = """
import json, os, sys
from gspo_core.platform import RuntimeOptions, prepare_process
applied = prepare_process(RuntimeOptions(keep_freed_memory=sys.argv[1] == "keep"))
print(json.dumps({"applied": applied, "mp": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")}))
"""


def _prepare_in_child(mode: str, **env) -> dict:
    child_env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**child_env, "PYTHONPATH": str(ROOT), **env},
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU")
def test_prepare_job_puts_vllm_in_its_own_processes_bound_per_device_only_at_n_above_one(monkeypatch):
    # Both set first, so monkeypatch puts back whatever this process had when the test ends.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "unset")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    assert prepare_job(1) == [] and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    assert prepare_job(2) == ["vllm_own_processes", "vllm_cpu_threads_bind"]
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == cpu_shares(sorted(os.sched_getaffinity(0)), 2)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0,1|0,1")  # the operator's binding is kept
    assert prepare_job(2) == ["vllm_own_processes"] and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|0,1"


def test_cpu_shares_split_the_cpus_per_device():
    assert cpu_shares([0, 1], 2) == "0|1"
    assert cpu_shares([0, 1, 2, 3, 4], 2) == "0,1|2,3"
    assert cpu_shares([5], 2) == "5|5"


@pytest.mark.vllm
@pytest.mark.parametrize(("size", "devices", "refused"), [(32, 1, False), (32, 2, True), (64, 2, False)])
def test_an_moe_whose_experts_vllm_cpu_would_pad_is_refused_before_the_engine_starts(tmp_path, size, devices, refused):
    """vLLM 0.32 on CPU pads a device's share of the experts' intermediate size to 32 and then cannot take a
    weight update into them (the engine dies mid-push): such a model and device count is refused up front."""
    if not vllm_available():
        pytest.skip("vllm not installed")
    from transformers import Qwen3MoeConfig

    from gspo_core.platform import cpu_moe

    Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=size, num_experts=4, head_dim=32).save_pretrained(tmp_path)
    args = {"dtype": "float32", "max_model_len": 64, "max_num_seqs": None, "max_new_tokens": None}
    if refused and cpu_moe.has_defect():
        with pytest.raises(ValueError, match=f"model: moe_intermediate_size {size} over {devices} device"):
            CpuPlatform().vllm_engine_args(model_dir=str(tmp_path), tensor_parallel_size=devices, **args)
    else:
        CpuPlatform().vllm_engine_args(model_dir=str(tmp_path), tensor_parallel_size=devices, **args)


@pytest.mark.skipif(not sys.platform.startswith("linux") or torch.cuda.is_available(), reason="CPU, glibc")
def test_prepare_process_applies_the_heap_policy_only_when_asked():
    kept, default = _prepare_in_child("keep"), _prepare_in_child("return")
    assert kept["applied"] == ["vllm_in_process", "keep_freed_memory"] and kept["mp"] == "0"
    assert default["applied"] == ["vllm_in_process"] and default["mp"] == "0"
    # The operator's explicit choice is kept (the vLLM engine then refuses to start, naming it).
    assert _prepare_in_child("return", VLLM_ENABLE_V1_MULTIPROCESSING="1")["mp"] == "1"


@pytest.mark.vllm
def test_cpu_vllm_arguments(tiny_model_dir):
    """Eager, no chunked prefill, 16-token blocks for short fp32 completions on x86, a cache sized to the job."""
    if not vllm_available():
        pytest.skip("vllm not installed")
    args = CpuPlatform().vllm_engine_args(
        model_dir=str(tiny_model_dir), dtype="float32", max_model_len=64, max_num_seqs=8, max_new_tokens=16
    )
    block = CPU_SHORT_KV_BLOCK if X86 else CPU_KV_BLOCK
    assert args == {
        "enforce_eager": True,
        "enable_chunked_prefill": False,
        "block_size": block,
        **cpu_kv_cache(str(tiny_model_dir), "float32", 8, 64, block),
    }
    unsized = CpuPlatform().vllm_engine_args(
        model_dir=str(tiny_model_dir), dtype="float32", max_model_len=64, max_num_seqs=None, max_new_tokens=None
    )
    assert unsized == {"enforce_eager": True, "enable_chunked_prefill": False, "block_size": CPU_KV_BLOCK}


@pytest.mark.skipif(not X86, reason="the rule names x86's kernels")
def test_16_token_blocks_from_the_precision_and_the_cpu_flags(tmp_path):
    with_amx, without = tmp_path / "amx", tmp_path / "plain"
    with_amx.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n")
    without.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert runs_16_token_blocks("float32", str(with_amx)) and runs_16_token_blocks("float32", str(without))
    assert not runs_16_token_blocks("bfloat16", str(with_amx)) and runs_16_token_blocks("bfloat16", str(without))
    assert not runs_16_token_blocks("bfloat16", str(tmp_path / "missing"))  # unknown: keep 32


def test_runtime_options_are_checked_by_name():
    assert RuntimeOptions() == RuntimeOptions.from_mapping({})
    assert RuntimeOptions.from_mapping({"rollout_engine": "transformers"}).rollout_engine == "transformers"
    for bad, name in [
        ({"rollout_engine": "tgi"}, "rollout_engine"),
        ({"vllm_gpu_memory_utilization": 0.99}, "vllm_gpu_memory_utilization"),
        ({"vllm_gpu_memory_utilization": True}, "vllm_gpu_memory_utilization"),
        ({"keep_freed_memory": "yes"}, "keep_freed_memory"),
        ({"cpu_gemm": "onednn"}, "cpu_gemm"),
    ]:
        with pytest.raises(ValueError, match=name):
            RuntimeOptions.from_mapping(bad)


def test_an_accelerator_platform_keeps_vllms_own_defaults():
    assert Platform().name == "accelerator" and not isinstance(Platform(), CpuPlatform)
