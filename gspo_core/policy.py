"""The trainable policy: loading (full or LoRA), batched completion logprobs, and weight export."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias, cast, overload

import torch

from gspo_core.config import GSPOConfig
from gspo_core.packing import PackedBatch, SharedPrefixBatch
from gspo_core.token_logprobs import head_logprobs, token_logprobs

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
    from typing_extensions import TypeIs

#: The trainable policy: a transformers causal LM, or a PEFT (LoRA) wrapper around one.
Policy: TypeAlias = "PreTrainedModel | PeftModel"
log = logging.getLogger(__name__)


class LMHead(Protocol):
    """What the trainer uses of a model's LM head: an ``nn.Linear``, or an adapter layer wrapping one."""

    weight: torch.Tensor

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor: ...


def is_peft(model: Policy) -> TypeIs[PeftModel]:
    """Whether the policy is a PEFT (LoRA) wrapper rather than the transformers model itself."""
    return hasattr(model, "get_base_model")


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def autocast_dtype(cfg: GSPOConfig, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPU (or when asked), fp32 on CPU."""
    if cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def sampler_dtype(amp_dtype: torch.dtype | None) -> str:
    """The rollout engine's precision: the trainer's own. Under bf16 autocast the transformers engine
    then runs the trainer's ops (old_logprobs=auto measured 0 error on the toy model, 7e-4 with an fp32
    sampler, which made every step recompute); vLLM's bf16 kernels still miss the tolerance, but its
    fp32 GEMMs run well below its bf16 rate on CPUs with AMX and on GPUs (docs/bench.md)."""
    return "bfloat16" if amp_dtype == torch.bfloat16 else "float32"


def load_policy(model_path: str, cfg: GSPOConfig, device: torch.device) -> tuple[Policy, PreTrainedTokenizerBase]:
    """Load the causal LM (fp32 master weights) + tokenizer; wrap with LoRA when ``lora_rank > 0``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    except (OSError, ValueError) as exc:
        raise OSError(
            f"cannot load model {model_path!r} (a Hugging Face id the machine can download, or a "
            f"local directory with config.json and weights): {str(exc).splitlines()[0][:300]}"
        ) from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
        if cfg.lora_rank > 0:  # frozen embeddings: checkpointed blocks need an input that requires grad
            model.enable_input_require_grads()
    if cfg.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=cfg.lora_rank,
                # peft annotates lora_alpha as int, but only divides by it (scaling = alpha / r): a
                # fractional alpha is what the job asked for.
                lora_alpha=cfg.lora_alpha,  # type: ignore[arg-type]
                lora_dropout=0.0,
                target_modules=lora_targets(model, cfg.lora_target_modules),
                task_type="CAUSAL_LM",
            ),
        )
    disable_dropout(model)
    check_logit_head(model)
    model.train()
    return model, tokenizer


def lora_targets(model: PreTrainedModel, names: Iterable[str]) -> list[str]:
    """``names`` less the LM head's where the model ties it to its input embeddings: the weight push and the
    export carry one tensor for the tied pair, so an adapter on the head would reach the trainer alone."""
    names = list(names)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return names
    head_path = next(path for path, module in model.named_modules() if module is head)
    kept = [name for name in names if name not in (head_path, head_path.rsplit(".", 1)[-1])]
    if len(kept) < len(names):
        log.warning("LoRA: %s is tied to the input embeddings; it gets no adapter", head_path)
    if not kept:
        raise ValueError(f"lora_target_modules: {names} name only the tied LM head; nothing to adapt")
    return kept


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout probability of the model (modules and the float rates attention layers read).

    GSPO compares two forwards' log-probs to within its clip range (3e-4 on the mean of a sequence): a
    random dropout mask in either would make the ratio noise and clip most rows. The model's saved
    config keeps its rates: only this process's modules change.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        rates = [k for k, v in vars(module).items() if isinstance(v, float) and ("dropout" in k or "pdrop" in k)]
        for name in rates:
            setattr(module, name, 0.0)


def one_tied_gradient(model: Policy) -> bool:
    """Where the input embedding and the LM head share one trained weight (tied), make the embedding's gradient
    sparse (the rows of the batch's tokens), so :func:`completion_logprobs` can have the head add its gradient
    straight into the weight's ``.grad`` and the embedding's rows go into the same buffer: one ``[V, H]`` where
    autograd holds the head's and the embedding's dense one (and, past a micro-batch, ``.grad``) at once. Not
    under FSDP, whose reduction follows autograd's accumulation (`gspo_core.distributed.shard` calls this on
    one rank only). Returns whether the weight is tied so."""
    base = base_model(model)
    embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    if not isinstance(embed, torch.nn.Embedding) or head is None or head.weight is not embed.weight:
        return False
    if not embed.weight.requires_grad:
        return False
    embed.sparse = True
    return True


def _head_adds_into_grad(model: Policy, head: LMHead) -> bool:
    """Whether the head's backward adds into its weight's ``.grad``: that weight is a leaf, tied to an
    embedding whose gradient is sparse (:func:`one_tied_gradient`)."""
    embed = base_model(model).get_input_embeddings()
    return bool(getattr(embed, "sparse", False)) and embed.weight is head.weight and head.weight.is_leaf


def logit_postprocess(config: PretrainedConfig) -> tuple[float, float | None]:
    """``(scale, softcap)`` a model family's forward applies to its LM head's output ``z``: logits are
    ``scale * softcap * tanh(z / softcap)`` (or ``scale * z`` without a cap). Cohere multiplies by
    ``logit_scale``, Granite divides by ``logits_scaling``, Gemma 2+ soft-caps; vLLM applies the same."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = float(getattr(text_config, "logit_scale", None) or 1.0) / float(
        getattr(text_config, "logits_scaling", None) or 1.0
    )
    softcap = getattr(text_config, "final_logit_softcapping", None)
    return scale, (float(softcap) if softcap else None)


@torch.no_grad()
def check_logit_head(model: Policy, tol: float = 1e-3) -> None:
    """Refuse a model whose own logits are not what :func:`completion_logprobs` computes from its trunk
    and head (a post-processing step :func:`logit_postprocess` does not know): the trainer would score
    a different distribution than the sampler draws from. One 8-token forward, at load."""
    base = base_model(model)
    trunk, head = _trunk_and_head(model)
    was_training = base.training
    base.eval()
    try:
        ids = torch.arange(8, device=head.weight.device).remainder(head.weight.shape[0]).unsqueeze(0)
        want = base(input_ids=ids).logits.float().log_softmax(-1)
        got = _postprocessed(head(trunk(input_ids=ids).last_hidden_state).float(), base.config).log_softmax(-1)
    finally:
        base.train(was_training)
    err = float((got - want).abs().max())
    if not err <= tol:
        raise ValueError(
            f"{type(base).__name__}: its forward post-processes the LM head's logits in a way the "
            f"trainer does not reproduce (log-probs differ by up to {err:.3g}); this model family "
            f"is not supported yet"
        )


def _postprocessed(z_FV: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    scale, softcap = logit_postprocess(config)
    if softcap is not None:
        z_FV = torch.tanh(z_FV / softcap) * softcap
    return z_FV * scale if scale != 1.0 else z_FV


def base_model(model: Policy) -> PreTrainedModel:
    """The transformers model inside a PEFT wrapper (the model itself when unwrapped); a LoRA
    adapter's layers sit inside it, so its forward is the adapted one."""
    # peft types get_base_model() as any Module; it is the transformers model the wrapper was built on.
    return cast("PreTrainedModel", model.get_base_model()) if is_peft(model) else model


def _trunk_and_head(model: Policy) -> tuple[torch.nn.Module, LMHead]:
    """The decoder stack and LM head of a (possibly PEFT-wrapped) causal LM."""
    base = base_model(model)
    return base.get_decoder(), base.get_output_embeddings()


@overload
def completion_logprobs(
    model: Policy,
    batch: PackedBatch | SharedPrefixBatch,
    temperature: float,
    amp_dtype: torch.dtype | None = None,
    with_entropy: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def completion_logprobs(
    model: Policy,
    batch: PackedBatch | SharedPrefixBatch,
    temperature: float,
    amp_dtype: torch.dtype | None = None,
    *,
    with_entropy: Literal[True],
) -> tuple[torch.Tensor, float]: ...


def completion_logprobs(
    model: Policy,
    batch: PackedBatch | SharedPrefixBatch,
    temperature: float,
    amp_dtype: torch.dtype | None = None,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, float]:
    """Log-probs ``[B, T]`` of the completion tokens under ``log_softmax(logits / temperature)``, where
    ``logits`` are the model's own (its family's scaling or soft-capping applied: :func:`logit_postprocess`).

    ``batch`` is plain rows or rows sharing prompt passes (:mod:`gspo_core.packing`). The LM head runs
    only on completion positions (not the prompt), which saves most of the vocabulary projection;
    the head's matmul, log-softmax, gather and entropy run fused, a chunk at a time, and the head's
    backward skips positions with a zero gradient (:mod:`gspo_core.token_logprobs`; a head that is not
    a plain ``nn.Linear``, e.g. a LoRA-wrapped one, runs as a module). With ``with_entropy`` also
    returns the mean token entropy (detached).
    """
    trunk, head = _trunk_and_head(model)
    config = base_model(model).config
    device_type = batch.target_BT.device.type
    autocast = torch.autocast(device_type=device_type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None)
    with autocast:
        h_BTH = batch.hidden_BTH(trunk)
    B, T, H = h_BTH.shape
    target_F = batch.target_BT.reshape(-1)
    scale, softcap = logit_postprocess(config)
    # softmax(scale * z / t) is softmax(z / (t / scale)): a constant scale is a temperature.
    if type(head) is torch.nn.Linear and softcap is None:
        into_grad = _head_adds_into_grad(model, head)
        logp_F, entropy_F = head_logprobs(
            h_BTH.reshape(B * T, H), head, target_F, temperature / scale, with_entropy, amp_dtype, into_grad
        )
    else:
        with autocast:
            z_FV = head(h_BTH.reshape(B * T, H)).float()
        logp_F, entropy_F = token_logprobs(_postprocessed(z_FV, config), target_F, temperature, with_entropy)
    # Selected, not multiplied: padding and an episode's environment tokens give exactly 0, value and gradient.
    sampled_BT = batch.mask_BT.bool()
    logp_BT = torch.where(sampled_BT, logp_F.view(B, T), 0.0)
    if not with_entropy:
        return logp_BT
    entropy = float(torch.where(sampled_BT, entropy_F.view(B, T), 0.0).sum() / batch.mask_BT.sum().clamp(min=1))
    return logp_BT, entropy


#: Where a PEFT wrapper's state dict names its transformers model.
PEFT_PREFIX = "base_model.model."


def export_weights(model: Policy, state: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full weights for the rollout engine and the HF export, from ``state`` (the model's full state
    dict, e.g. gathered from its shards: `gspo_core.distributed.gather_state_dict`; default the model's own).
    A LoRA layer's weight is made as ``W + scaling * B @ A``, one new tensor at a time. (Merging into ``W`` and
    unmerging again would leave ``W`` off by rounding, differently after each push, and break exact resume
    from a checkpoint's clean base weights.)"""
    state = model.state_dict() if state is None else state
    if not is_peft(model):
        yield from state.items()
        return
    base = model.get_base_model()
    for name, tensor in state.items():
        name = name.removeprefix(PEFT_PREFIX)
        if "lora_" in name:
            continue
        if name.endswith(".base_layer.weight"):
            path = name[: -len(".base_layer.weight")]
            layer: Any = base.get_submodule(path)
            with torch.no_grad():
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        tensor = tensor + _lora_delta(layer, adapter, state, PEFT_PREFIX + path).to(tensor.dtype)
        yield name.replace(".base_layer", ""), tensor.detach()


def checkpoint_weights(
    model: Policy, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (:func:`export_weights`) named and shaped as the model's checkpoint holds them: the
    conversion ``save_pretrained`` applies (transformers' ``revert_weight_conversion``). transformers 5 holds
    some MoE experts fused in memory (``mlp.experts.gate_up_proj [E, 2I, H]``) where checkpoints have one
    tensor per expert (Mixtral: ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``), and vLLM's loaders read
    checkpoint names. Other tensors pass as they are (no copy); an expert's tensor is a view of the fused one."""
    from transformers.core_model_loading import revert_weight_conversion

    base = model.get_base_model() if is_peft(model) else model
    yield from revert_weight_conversion(base, dict(weights)).items()


def _lora_delta(layer: Any, adapter: str, state: dict[str, torch.Tensor], path: str) -> torch.Tensor:
    """``scaling * B @ A`` of a LoRA ``Linear`` layer, from the state dict's tensors (the layer's own may be
    shards)."""
    if not hasattr(layer, "fan_in_fan_out"):
        raise ValueError(f"{path}: LoRA on a {type(layer).__name__} layer is not supported (Linear layers only)")
    a_weight = state[f"{path}.lora_A.{adapter}.weight"].float()
    b_weight = state[f"{path}.lora_B.{adapter}.weight"].float()
    delta = (b_weight @ a_weight) * layer.scaling[adapter]
    return delta.T if layer.fan_in_fan_out else delta


#: Largest safetensors file of an export: safetensors copies a file's GPU tensors to host memory all at once, so
#: this bounds the host memory a GPU job's export takes (transformers' default, 50 GB, made one file of a model).
EXPORT_SHARD_SIZE = "1GB"


def save_hf(
    model: Policy,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    state: dict[str, torch.Tensor] | None = None,
    adapter_dir: Path | None = None,
) -> None:
    """Hugging Face directory that transformers and vLLM load as is (merged model for LoRA), from ``state``
    (the model's full state dict, as :func:`export_weights` takes it; default the model's own); a LoRA
    adapter also goes to ``adapter_dir`` (default: ``adapter`` beside ``out_dir``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = model.state_dict() if state is None else state
    if is_peft(model):
        # peft saves the adapter's tensors out of the state dict it is given (the live ones may be shards)
        model.save_pretrained(str(adapter_dir or out_dir.parent / "adapter"), state_dict=state)
        # export_weights yields the given tensors of layers without an adapter: clone them
        merged = {name: tensor.clone() for name, tensor in export_weights(model, state)}
        base_model(model).save_pretrained(str(out_dir), state_dict=merged, max_shard_size=EXPORT_SHARD_SIZE)
    else:
        model.save_pretrained(str(out_dir), state_dict=state, max_shard_size=EXPORT_SHARD_SIZE)
    tokenizer.save_pretrained(str(out_dir))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(str(out_dir))
