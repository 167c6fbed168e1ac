"""`gspo train job.yaml`: the job's fields, and how this machine runs it in a section (or flags) of its own."""

from __future__ import annotations

import pytest
import yaml

from gspo_core.cli import load_job
from gspo_core.platform import RuntimeOptions


def _job(tmp_path, **extra) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": "m",
                "training_file": "t.jsonl",
                "reward": {"type": "regex", "pattern": "a"},
                "hyperparameters": {"steps": 2},
                **extra,
            }
        )
    )
    return str(path)


def test_the_runtime_section_and_flags_are_not_hyperparameters(tmp_path):
    spec, runtime = load_job(_job(tmp_path), None, {})
    assert runtime == RuntimeOptions() and spec.hyperparameters.steps == 2
    path = _job(tmp_path, runtime={"rollout_engine": "transformers", "keep_freed_memory": False})
    spec, runtime = load_job(path, None, {"steps": 3})
    assert runtime == RuntimeOptions(rollout_engine="transformers", keep_freed_memory=False)
    assert spec.hyperparameters.steps == 3
    _, runtime = load_job(path, None, {}, {"rollout_engine": "vllm"})  # a flag over the section
    assert runtime.rollout_engine == "vllm" and not runtime.keep_freed_memory


@pytest.mark.parametrize(
    "extra,overrides,message",
    [
        (
            {"hyperparameters": {"rollout_engine": "transformers"}},
            {},
            "hyperparameters.rollout_engine: .*--rollout-engine",
        ),
        ({}, {"keep_freed_memory": False}, "hyperparameters.keep_freed_memory: .*--return-freed-memory"),
        ({"runtime": {"rollout_engine": "tgi"}}, {}, "runtime: rollout_engine"),
        ({"runtime": {"cpu_gemm": "onednn"}}, {}, "runtime: unknown runtime option"),
    ],
)
def test_misplaced_or_bad_runtime_options_are_refused_by_name(tmp_path, extra, overrides, message):
    with pytest.raises(ValueError, match=message):
        load_job(_job(tmp_path, **extra), None, overrides)
