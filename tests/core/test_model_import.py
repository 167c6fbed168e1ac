"""`gspo models import`: a real GGUF (SmolLM2-135M-Instruct) round trip, Hugging Face directories, and the
errors for GGUF files transformers cannot load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_core.model_import import ModelImportError, gguf_architecture, import_model

ROOT = Path(__file__).resolve().parents[2]
QUESTION = [{"role": "user", "content": "What is 17 + 25?"}]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    """The imported directory's model and tokenizer, loaded once for the module."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(smollm2_dir))


def _gguf(smollm2_dir: Path) -> Path:
    return next(smollm2_dir.parent.glob("*.gguf"))


def _chat_ids(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.no_grad()
def test_the_imported_gguf_has_the_gguf_models_logits(smollm2_dir, smollm2):
    """Parity against transformers' own GGUF load (dequantized fp32), on a chat-formatted prompt."""
    from transformers import AutoModelForCausalLM

    gguf = _gguf(smollm2_dir)
    assert gguf_architecture(gguf) == "llama"
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    model, tokenizer = smollm2
    ids_1L = torch.tensor([_chat_ids(tokenizer)])
    diff = (reference(ids_1L).logits - model(ids_1L).logits).abs().max().item()
    assert diff < 1e-3, diff
    # tied embeddings: one tensor, saved once, and still one after the load
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.vocab_size == 49152


def test_the_imported_directory_stops_at_the_chat_templates_end_of_turn(smollm2_dir, smollm2):
    _, tokenizer = smollm2
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in generation["eos_token_id"]
    assert generation["pad_token_id"] == tokenizer.pad_token_id is not None
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.vllm
def test_transformers_and_vllm_greedy_decode_the_imported_model_alike(smollm2_dir, smollm2):
    vllm = pytest.importorskip("vllm")
    model, tokenizer = smollm2
    prompt = _chat_ids(tokenizer)
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
    llm = vllm.LLM(model=str(smollm2_dir), dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    try:
        out = llm.generate(
            [vllm.TokensPrompt(prompt_token_ids=prompt)], vllm.SamplingParams(temperature=0, max_tokens=8)
        )
        assert list(out[0].outputs[0].token_ids) == hf, (tokenizer.decode(hf), out[0].outputs[0].text)
    finally:
        del llm
    assert "17" in tokenizer.decode(hf)  # a real instruct model: it answers about the question


def _gspo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gspo_cli.main", "models", "import", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_gspo_models_import_copies_a_hugging_face_directory(tiny_model_dir, tmp_path):
    done = _gspo(str(tiny_model_dir), "--models-dir", str(tmp_path), "--name", "mine")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["model"] == "mine" and report["source_format"] == "hf"
    assert report["max_abs_logit_diff"] < 1e-5
    assert (tmp_path / "mine" / "model.safetensors").exists()
    again = _gspo(str(tiny_model_dir), "--models-dir", str(tmp_path), "--name", "mine")
    assert again.returncode == 1 and "already exists" in again.stderr
    strict = _gspo(str(tiny_model_dir), "--models-dir", str(tmp_path), "--name", "strict", "--tolerance", "-1")
    assert strict.returncode == 1 and "> tolerance -1)" in strict.stderr, strict.stderr


def _write_gguf(path: Path, architecture: str) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_architecture_transformers_cannot_dequantize_is_named(tmp_path):
    gguf = _write_gguf(tmp_path / "odd.gguf", "rwkv6")
    with pytest.raises(ModelImportError, match="architecture 'rwkv6'"):
        import_model(gguf, tmp_path / "models" / "odd")
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())
    done = _gspo(str(gguf), "--models-dir", str(tmp_path / "models"))
    assert done.returncode == 1 and "architecture 'rwkv6'" in done.stderr, done.stderr


def test_a_file_that_is_not_a_gguf_is_refused(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelImportError, match="not a readable GGUF"):
        import_model(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_chat_templates_end_of_turn_joins_an_eos_that_differs(smollm2_dir):
    """A GGUF whose EOS is the end of text (Qwen-style) still stops chat completions at the end of the turn."""
    from transformers import AutoTokenizer

    from gspo_core.model_import import end_of_turn_ids

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert end_of_turn_ids(tokenizer) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    tokenizer.eos_token = "<|endoftext|>"
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    assert end_of_turn_ids(tokenizer) == ids
