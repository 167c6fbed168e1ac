"""Import a GGUF file or a Hugging Face directory as a trainable Hugging Face directory (fp32 safetensors).

transformers dequantizes a GGUF to fp32 on load (with the ``gguf`` package) but refuses to save the model it
built ("quantized with QuantizationMethod.GGUF"): the importer copies its state dict into a plain model of
the same config, saves that with the tokenizer (chat template included) and a generation config whose EOS
is the chat template's end of turn, loads the saved directory back and compares its logits with the
GGUF-loaded model's on a chat-formatted probe. Nothing is left at the destination unless all of that passed.
"""

from __future__ import annotations

import copy
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

#: Largest |logit| difference accepted between the source and the saved model: both are the same fp32
#: weights, so only kernel-order rounding separates them (measured ~1e-5 on SmolLM2-135M).
DEFAULT_TOLERANCE = 1e-3
PROBE_MESSAGES = [{"role": "user", "content": "What is 17 + 25? Answer with the number."}]


class ModelImportError(ValueError):
    """The source cannot be imported (unsupported architecture, unreadable file, parity failure)."""


@dataclass(frozen=True)
class ImportReport:
    """What an import produced: where, which architecture, and how close the saved model is to its source."""

    path: Path
    source_format: str  # "gguf" | "hf"
    architecture: str
    parameters: int
    tied_embeddings: bool
    max_abs_logit_diff: float
    eos_token_ids: list[int]
    pad_token_id: int
    has_chat_template: bool


def gguf_architecture(path: Path) -> str:
    """The ``general.architecture`` a GGUF file declares (``"llama"``, ``"qwen2"``, ...)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
    except (KeyError, ValueError, OSError) as exc:
        raise ModelImportError(f"{path}: not a readable GGUF file ({exc})") from exc
    return bytes(field.parts[field.data[0]]).decode()


def _load_source(source: Path):
    """``(model, tokenizer, format, architecture)`` of a GGUF file or a Hugging Face directory, in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.is_dir():
        if not (source / "config.json").exists():
            raise ModelImportError(f"{source}: a Hugging Face directory needs a config.json")
        tokenizer = AutoTokenizer.from_pretrained(str(source))
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
        return model, tokenizer, "hf", model.config.model_type
    if not source.is_file():
        raise ModelImportError(f"{source}: no such file or directory")
    architecture = gguf_architecture(source)
    kwargs = {"gguf_file": source.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), dtype=torch.float32, **kwargs)
    except (ValueError, KeyError, NotImplementedError, RuntimeError) as exc:
        raise ModelImportError(
            f"{source}: transformers cannot load a GGUF of architecture {architecture!r} "
            f"({str(exc).splitlines()[0][:300]})"
        ) from exc
    return model, tokenizer, "gguf", architecture


def _plain_copy(model):
    """A model of ``model``'s config without its quantization config, holding its tensors (fp32)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = plain.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in result.missing_keys if k not in _tied_keys(plain)]
    if missing or result.unexpected_keys:
        raise ModelImportError(f"state dict mismatch: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")
    if config.tie_word_embeddings:
        plain.tie_weights()
    return plain.eval()


def _tied_keys(model) -> set[str]:
    return {"lm_head.weight"} if model.config.tie_word_embeddings else set()


def end_of_turn_ids(tokenizer) -> list[int]:
    """EOS ids a chat completion may stop on: the tokenizer's EOS and the token that closes an assistant turn
    in its chat template (ChatML's ``<|im_end|>`` where the GGUF's EOS is ``<|endoftext|>``)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if tokenizer.chat_template:
        turn = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], tokenize=True
        )
        turn = list(turn["input_ids"] if isinstance(turn, dict) or hasattr(turn, "keys") else turn)
        y_at = max((i for i, t in enumerate(turn) if tokenizer.decode([t]).strip() == "y"), default=len(turn))
        if y_at + 1 < len(turn) and turn[y_at + 1] not in ids:
            ids.append(turn[y_at + 1])
    return ids


def _probe_ids(tokenizer) -> torch.Tensor:
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(PROBE_MESSAGES, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    else:
        ids = tokenizer(PROBE_MESSAGES[0]["content"])["input_ids"]
    return torch.tensor([ids])


@torch.no_grad()
def _max_logit_diff(reference, saved_dir: Path, probe_1L: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(saved_dir), dtype=torch.float32).eval()
    want_1LV = reference.eval()(probe_1L).logits
    got_1LV = saved(probe_1L).logits
    return float((want_1LV - got_1LV).abs().max())


def import_model(source: Path, dest: Path, *, tolerance: float = DEFAULT_TOLERANCE) -> ImportReport:
    """Write ``source`` (a ``.gguf`` file or a Hugging Face directory) to ``dest`` as fp32 safetensors with its
    tokenizer and generation config, after checking the saved model's logits against the source's."""
    from transformers import GenerationConfig

    source, dest = Path(source), Path(dest)
    if dest.exists():
        raise ModelImportError(f"{dest} already exists (pick another --name, or remove it)")
    model, tokenizer, source_format, architecture = _load_source(source)
    plain = _plain_copy(model) if source_format == "gguf" else model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos_ids = end_of_turn_ids(tokenizer)
    plain.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id
    )
    partial = dest.with_name(f".{dest.name}.partial-{uuid.uuid4().hex[:8]}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        plain.save_pretrained(str(partial), safe_serialization=True)
        tokenizer.save_pretrained(str(partial))
        diff = _max_logit_diff(model, partial, _probe_ids(tokenizer))
        if not diff <= tolerance:
            raise ModelImportError(
                f"logits of the saved model differ from {source.name}'s by {diff:.3g} (> tolerance {tolerance:g})"
            )
        os.replace(partial, dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return ImportReport(
        path=dest,
        source_format=source_format,
        architecture=architecture,
        parameters=sum(p.numel() for p in plain.parameters()),
        tied_embeddings=bool(plain.config.tie_word_embeddings),
        max_abs_logit_diff=diff,
        eos_token_ids=eos_ids,
        pad_token_id=int(tokenizer.pad_token_id),
        has_chat_template=bool(tokenizer.chat_template),
    )
