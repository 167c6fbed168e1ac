"""The trainable policy: loading (full or LoRA), batched completion logprobs, and weight export."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from gspo_core.config import GSPOConfig
from gspo_core.token_logprobs import token_logprobs


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def autocast_dtype(cfg: GSPOConfig, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPU (or when asked), fp32 on CPU."""
    if cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def load_policy(model_path: str, cfg: GSPOConfig, device: torch.device):
    """Load the causal LM (fp32 master weights) + tokenizer; wrap with LoRA when ``lora_rank > 0``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot load model {model_path!r} (a Hugging Face id the machine can download, or a "
                      f"local directory with config.json and weights): {str(exc).splitlines()[0][:300]}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
        if cfg.lora_rank > 0:  # frozen embeddings: checkpointed blocks need an input that requires grad
            model.enable_input_require_grads()
    if cfg.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
            target_modules=list(cfg.lora_target_modules), task_type="CAUSAL_LM"))
    model.train()
    return model, tokenizer


def _trunk_and_head(model):
    """The decoder stack and LM head of a (possibly PEFT-wrapped) causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


@dataclass
class PackedBatch:
    """Right-padded ``[prompt | completion]`` rows and where each completion token sits.

    ``input_BL``/``attn_BL``: token ids and attention mask. ``pos_BT``: index of the hidden state
    that predicts completion token t of row b. ``target_BT``/``mask_BT``: completion tokens and 1
    on real (not padded) ones.
    """

    input_BL: torch.Tensor
    attn_BL: torch.Tensor
    pos_BT: torch.Tensor
    target_BT: torch.Tensor
    mask_BT: torch.Tensor

    def to(self, device) -> "PackedBatch":
        return PackedBatch(*(t.to(device, non_blocking=True) for t in
                             (self.input_BL, self.attn_BL, self.pos_BT, self.target_BT, self.mask_BT)))


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> PackedBatch:
    """Build a :class:`PackedBatch` (rows sorted by caller; padding only to the batch's longest)."""
    B = len(prompts)
    L = max(len(p) + len(c) for p, c in zip(prompts, completions))
    T = max(1, max(len(c) for c in completions))
    input_BL = torch.full((B, L), pad_id, dtype=torch.long)
    attn_BL = torch.zeros((B, L), dtype=torch.long)
    pos_BT = torch.zeros((B, T), dtype=torch.long)
    target_BT = torch.full((B, T), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((B, T), dtype=torch.float32)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        input_BL[b, :n] = torch.tensor(p + c, dtype=torch.long)
        attn_BL[b, :n] = 1
        if c:
            pos_BT[b, : len(c)] = torch.arange(len(p) - 1, n - 1)
            target_BT[b, : len(c)] = torch.tensor(c, dtype=torch.long)
            mask_BT[b, : len(c)] = 1.0
    return PackedBatch(input_BL, attn_BL, pos_BT, target_BT, mask_BT)


def completion_logprobs(model, batch: PackedBatch, temperature: float,
                        amp_dtype: torch.dtype | None = None, with_entropy: bool = False):
    """Log-probs ``[B, T]`` of the completion tokens under ``log_softmax(logits / temperature)``.

    The LM head runs only on completion positions (not the prompt), which saves most of the
    vocabulary projection; the log-softmax, gather and entropy run fused, block by block
    (:mod:`gspo_core.token_logprobs`). With ``with_entropy`` also returns the mean token entropy
    (detached).
    """
    trunk, head = _trunk_and_head(model)
    device_type = batch.input_BL.device.type
    with torch.autocast(device_type=device_type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        hidden_BLH = trunk(input_ids=batch.input_BL, attention_mask=batch.attn_BL, use_cache=False).last_hidden_state
        idx_BTH = batch.pos_BT.unsqueeze(-1).expand(-1, -1, hidden_BLH.size(-1))
        hidden_BTH = hidden_BLH.gather(1, idx_BTH)
        z_BTV = head(hidden_BTH).float()
    B, T, V = z_BTV.shape
    logp_N, ent_N = token_logprobs(z_BTV.reshape(B * T, V), batch.target_BT.reshape(-1), temperature, with_entropy)
    logp_BT = logp_N.view(B, T) * batch.mask_BT
    if not with_entropy:
        return logp_BT
    entropy = float((ent_N.view(B, T) * batch.mask_BT).sum() / batch.mask_BT.sum().clamp(min=1))
    return logp_BT, entropy


def export_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full weights for the rollout engine; LoRA adapters are merged on the fly."""
    if not hasattr(model, "merge_adapter"):
        yield from model.state_dict().items()
        return
    model.merge_adapter()
    try:
        for name, tensor in model.get_base_model().state_dict().items():
            if "lora_" in name:
                continue
            yield name.replace(".base_layer", ""), tensor
    finally:
        model.unmerge_adapter()


def save_hf(model, tokenizer, out_dir: Path) -> None:
    """Hugging Face directory that transformers and vLLM load as is (merged model for LoRA)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "merge_and_unload"):
        model.save_pretrained(str(out_dir.parent / "adapter"))
        # export_weights yields views of the merged weights, unmerged again when it finishes
        state = {name: t.detach().clone() for name, t in export_weights(model)}
        base = model.get_base_model()
        base.save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)
    else:
        model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(str(out_dir))
