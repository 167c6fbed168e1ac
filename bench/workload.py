"""The shared workload of both trainers: model shape, prompts, reward, sizes (equal work for both)."""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from gspo_core.toy import SHAPES as TOY_SHAPES
from gspo_core.toy import build_tiny_model, build_tokenizer, write_toy_dataset

#: Qwen2-architecture shapes for GPU runs (random init; the toy tokenizer padded to the vocabulary).
QWEN_SHAPES = {
    "qwen0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
    },
    "qwen-tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 2000,
    },
}
SHAPE_NAMES = (*TOY_SHAPES, *QWEN_SHAPES)


@dataclass(frozen=True)
class Workload:
    """``steps`` GSPO steps of ``prompts`` x ``group`` completions of exactly ``tokens`` tokens
    (EOS ignored, so both trainers do equal work), ``updates`` optimizer updates per rollout batch."""

    shape: str = "toy"
    steps: int = 4
    prompts: int = 8
    group: int = 8
    tokens: int = 32
    updates: int = 4
    lr: float = 3e-3
    seed: int = 0
    fixed_length: bool = True
    prompt_tokens: int = 0  # > 0: every prompt opens with the same instructions, this many characters (= tokens)
    model_dir: str = ""  # a Hugging Face directory to train instead of building ``shape`` (e.g. bench.smollm2's)
    #: Ours: most tokens one forward + backward holds (GSPOConfig.micro_batch_tokens); None: GSPOConfig's default.
    micro_batch_tokens: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def similarity(text: str, target: str) -> float:
    """The toy task's reward (the same function as the `text_similarity` grader's fuzzy_match)."""
    return difflib.SequenceMatcher(None, text, target).ratio()


def build_qwen(out: Path, shape: str) -> Path:
    """Build (once) a random-init Qwen2 model of ``shape`` (tied embeddings, as Qwen2-0.5B) in ``out``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if (out / "config.json").exists():
        return out
    dims = dict(QWEN_SHAPES[shape])
    tok = build_tokenizer(out, dims.pop("vocab_size"))
    cfg = Qwen2Config(
        **dims,
        vocab_size=len(tok),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    ).save_pretrained(str(out))
    return out


def prepare(w: Workload, root: Path) -> tuple[Path, Path]:
    """Build (once) the model of ``w.shape`` and the toy dataset; returns their paths."""
    out = root / f"model-{w.shape}"
    if w.model_dir:
        model = Path(w.model_dir)
    elif w.shape in TOY_SHAPES:
        model = build_tiny_model(out, shape=w.shape, seed=0)
    else:
        model = build_qwen(out, w.shape)
    data = write_toy_dataset(root / f"toy-p{w.prompt_tokens}.jsonl", n=256, seed=w.seed)
    if w.prompt_tokens:
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        data.write_text(
            "".join(json.dumps({**r, "prompt": instructions(w.prompt_tokens) + r["prompt"]}) + "\n" for r in rows)
        )
    return model, data


def instructions(n: int) -> str:
    """``n`` characters of a fixed instruction text (one token each with the toy tokenizers): RL prompts
    carry hundreds of tokens of task statement and format rules, where the toy task's are 9 tokens."""
    text = (
        "You are a careful assistant. Read the request below and answer with the requested letter, "
        "repeated, and nothing else: no spaces, no punctuation, no explanation. "
    )
    return (text * (n // len(text) + 1))[:n]
