"""Supervised rows: checks naming line and field, and loss masks exactly on the assistant turns."""

from __future__ import annotations

import io
import json

import pytest

from gspo_core.data import DataError, check_sft_file
from gspo_core.sft import chat_pieces, encode_chat


def test_mask_covers_exactly_the_weighted_assistant_turns(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "say a:"},
        {"role": "assistant", "content": "aaaa"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "zz", "weight": 0},
        {"role": "user", "content": "b?"},
        {"role": "assistant", "content": "bb"},
    ]
    pieces = chat_pieces(messages, tok)
    assert "".join(text for text, _ in pieces) == tok.apply_chat_template(messages, tokenize=False)
    assert [text for text, weight in pieces if weight] == ["aaaa\n", "bb\n"]  # the turn's end is generated too
    ids, weights = encode_chat(messages, tok, 1000)
    assert tok.decode([i for i, w in zip(ids, weights, strict=True) if w]) == "aaaa\nbb\n"
    assert encode_chat(messages, tok, 10) == (ids[:10], weights[:10])


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"prompt": "x"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "weight": 1}]}, "messages[0].weight"),
        ({"messages": [{"role": "assistant", "content": "x", "weight": 0.5}]}, "messages[0].weight"),
        ({"messages": [{"role": "assistant", "content": "x", "weight": True}]}, "messages[0].weight"),
        ({"messages": [{"role": "assistant", "content": "x", "weight": 0}]}, "messages"),
    ],
)
def test_bad_supervised_rows_name_line_and_field(row, field):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    data = (json.dumps(good) + "\n\n" + json.dumps(row) + "\n").encode()
    with pytest.raises(DataError) as exc:
        check_sft_file(io.BytesIO(data))
    assert (exc.value.line, exc.value.field) == (3, field)
    assert check_sft_file(io.BytesIO((json.dumps(good) + "\n").encode())) == 1


CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nbe kind<|im_end|>\n"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: ChatML with Hugging Face's generation markers around what the model generates.
CHATML_GENERATION = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Llama 3's shape: a BOS, headers, and contents trimmed (so a content with outer spaces is not put in verbatim).
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
#: A generation prompt shorter than the assistant's header: the answer's piece starts with the space.
SPACED = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
ROWS = [
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "same"},
        {"role": "assistant", "content": "same"},  # the user's text again: found by position, not by search
        {"role": "user", "content": "x<|im_end|>\n<|im_start|>assistant\nsame"},
        {"role": "assistant", "content": "", "weight": 0},
        {"role": "assistant", "content": "two in a row<|im_end|>\n"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": " spaced out \n", "weight": 1},
        {"role": "user", "content": "last"},
    ],
    [{"role": "user", "content": "\ue000 0\ue001"}, {"role": "assistant", "content": "mark-like \ue0000\ue001"}],
]


def _encode_by_prefixes(messages, tok, max_tokens):
    """The encoding as it was: each piece of the prefix renders tokenized on its own."""
    from gspo_core.sft import prefix_pieces

    ids, weights = [], []
    for text, weight in prefix_pieces(messages, tok):
        if text:
            piece = tok(text, add_special_tokens=False)["input_ids"]
            ids += piece
            weights += [weight] * len(piece)
    return ids[:max_tokens], weights[:max_tokens]


@pytest.mark.parametrize("template", ["toy", CHATML, CHATML_GENERATION, LLAMA3, SPACED])
def test_one_render_encodes_as_the_prefix_renders_did(tiny_model_dir, template):
    """The linear encoding gives the pieces and tokens of the definition (every prefix rendered), on templates
    with and without generation markers, and on rows where a search for the contents would go wrong."""
    from transformers import AutoTokenizer

    from gspo_core.sft import prefix_pieces

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    if template != "toy":
        tok.chat_template = template
    for messages in ROWS:
        assert chat_pieces(messages, tok) == prefix_pieces(messages, tok)
        for max_tokens in (1000, 7):
            assert encode_chat(messages, tok, max_tokens) == _encode_by_prefixes(messages, tok, max_tokens)


def _seconds_to_encode(messages, tok) -> float:
    import time

    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        encode_chat(messages, tok, 10**9)
        best = min(best, time.perf_counter() - start)
    return best


def test_encoding_time_grows_linearly_with_the_turns(tiny_model_dir):
    """4x the turns costs about 4x the time (the prefix renders cost 16x: a 2,000-pair row took 18.6 s)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = CHATML

    def row(pairs: int) -> list[dict]:
        turn = [{"role": "user", "content": "what is 2 + 2?" * 3}, {"role": "assistant", "content": "4, " * 10}]
        return turn * pairs

    encode_chat(row(10), tok, 10**9)  # the template compiled, the frame learnt
    small, large = _seconds_to_encode(row(500), tok), _seconds_to_encode(row(2000), tok)
    print(f"500 turn pairs: {small:.3f} s, 2000: {large:.3f} s ({large / small:.1f}x)")
    assert large / small < 8, (small, large)


def test_a_row_is_encoded_once_per_job(tiny_model_dir, tmp_path):
    """Every epoch trains on the same tokens: the second pass over the rows reuses the first's encodings."""
    from gspo_core.config import GSPOConfig, JobSpec
    from gspo_core.sft import SFTTrainer

    chats = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "ab" * i}] for i in range(1, 4)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    cfg = GSPOConfig(method="supervised", steps=3, prompts_per_step=3, group_size=2, mini_batches=1, shuffle=False)
    spec = JobSpec(
        model=str(tiny_model_dir),
        training_file=str(tmp_path / "chat.jsonl"),
        validation_file=str(tmp_path / "chat.jsonl"),
        reward={},
        hyperparameters=cfg,
    )
    trainer = SFTTrainer(spec, None)
    trainer.run_step(1)
    first = dict(trainer._encoded)
    assert sorted(first) == [("train", 0), ("train", 1), ("train", 2)]
    trainer.run_step(2)
    assert all(trainer._encoded[key] is first[key] for key in first) and len(trainer._encoded) == 3
    example = trainer.example("train", 2)
    assert (example.ids, example.weights) == encode_chat(chats[2], trainer.tokenizer, 64 + 512)
    assert trainer.evaluate()["eval/loss"] > 0 and ("val", 1) in trainer._encoded  # validation rows too


def test_a_supervised_job_stopped_and_resumed_ends_with_the_uninterrupted_weights(tiny_model_dir, tmp_path):
    """The loop's checkpoints and resume serve a supervised job as a GSPO one: the same steps, learning rates,
    losses and end weights as a run that was not stopped."""
    import torch
    from safetensors.torch import load_file

    from gspo_core.config import GSPOConfig, JobSpec
    from tests.core.trainer_support import Recorder, one_torch_thread, train

    chats = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "ab" * i}] for i in range(1, 9)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    hp = {"steps": 4, "prompts_per_step": 2, "learning_rate": 1e-3, "lr_schedule": "cosine", "warmup_steps": 1}
    cfg = GSPOConfig(method="supervised", **hp)

    def spec(out: str) -> JobSpec:
        files = {"training_file": str(tmp_path / "chat.jsonl"), "validation_file": str(tmp_path / "chat.jsonl")}
        return JobSpec(
            model=str(tiny_model_dir), reward={}, hyperparameters=cfg, output_dir=str(tmp_path / out), **files
        )

    with one_torch_thread():
        full_rec, rec = Recorder(), Recorder()
        full = train(spec("a"), full_rec)
        stopped = train(spec("b"), Recorder(stop_after=2))
        assert stopped.stopped and stopped.final_step == 2
        resumed = train(spec("b"), rec, resume_from=stopped.final_checkpoint)
    assert [s for s, _ in rec.steps] == [3, 4] and resumed.final_step == 4 and not resumed.stopped
    assert any("resumed from step-000002" in m for m in rec.logs)
    for name in ("loss", "lr"):
        assert [m[name] for _, m in full_rec.steps[3:]] == [m[name] for _, m in rec.steps], name
    a = load_file(f"{full.final_checkpoint}/model/model.safetensors")
    b = load_file(f"{resumed.final_checkpoint}/model/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
