"""Weights cross processes: vLLM in multiprocess mode gets pushes over our gloo engine, registered by entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_core.rollout import vllm_available

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.multiprocess]
ROOT = Path(__file__).resolve().parents[2]


def plugin_dist(where: Path) -> Path:
    """A distribution declaring our ``vllm.general_plugins`` entry point, as an installed package does:
    on PYTHONPATH, every process vLLM starts finds it (whatever the venv's own metadata says)."""
    dist = where / "gspo_weight_transfer_test-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: gspo-weight-transfer-test\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\ngspo_weight_transfer = gspo_core.rollout.weight_transfer:register\n"
    )
    return where


def main(model_dir: str) -> None:
    """In the child: an engine in multiprocess mode, two pushes, the engine's log-prob error after each."""
    import torch

    from gspo_core.config import GSPOConfig
    from gspo_core.policy import export_weights, load_policy
    from gspo_core.rollout import SamplingSpec
    from gspo_core.rollout.vllm_engine import VLLMEngine
    from tests.core.test_rollout_hf import reference_logprobs
    from tests.core.test_weight_transfer import perturb

    model, tok = load_policy(model_dir, GSPOConfig(), torch.device("cpu"))
    engine = VLLMEngine(model_dir, max_model_len=256, dtype="float32")
    prompt = tok("say a:")["input_ids"]
    spec = SamplingSpec(n=1, max_tokens=8, ignore_eos=True, seed=3)
    result: dict = {"backend": engine.llm.llm_engine.vllm_config.weight_transfer_config.backend, "errors": []}
    for seed in (1, 2):
        perturb(model, seed)
        engine.load_weights(export_weights(model))
        c = engine.generate([prompt], spec)[0][0]
        gap = (torch.tensor(c.logprobs) - reference_logprobs(model, prompt, c.completion_ids)).abs().max()
        result["errors"].append(float(gap))
    engine.close()
    print("RESULT " + json.dumps(result), flush=True)


def test_pushes_reach_a_multiprocess_engine_over_gloo(tiny_model_dir, tmp_path):
    """vLLM's engine core and worker in their own processes: the entry point registers our engines
    there, the push goes over gloo, and after each push the engine's log-probs are the trainer's."""
    if not vllm_available():
        pytest.skip("vllm not installed")
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "PYTHONPATH": os.pathsep.join([str(plugin_dist(tmp_path)), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "tests.core.test_weight_transfer_mp", str(tiny_model_dir)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["backend"] == "gspo_gloo"
    assert max(result["errors"]) < 1e-5, result


if __name__ == "__main__":
    main(sys.argv[1])
