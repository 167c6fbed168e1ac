"""The benchmark workload: both trainers read the same prompts, long-prompt variant included."""

from __future__ import annotations

import json

from bench.workload import Workload, instructions, prepare


def test_prompt_tokens_prefix_every_prompt_with_the_same_instructions(tmp_path):
    _, plain = prepare(Workload(shape="toy"), tmp_path)
    model, long = prepare(Workload(shape="toy", prompt_tokens=300), tmp_path)
    rows = [json.loads(line) for line in plain.read_text().splitlines()]
    long_rows = [json.loads(line) for line in long.read_text().splitlines()]
    assert len(instructions(300)) == 300 and len(rows) == len(long_rows) == 256
    assert [r["prompt"] for r in long_rows] == [instructions(300) + r["prompt"] for r in rows]
    assert [r["target"] for r in long_rows] == [r["target"] for r in rows]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)  # character-level: 300 characters are 300 tokens
    assert len(tok(instructions(300), add_special_tokens=False)["input_ids"]) == 300
