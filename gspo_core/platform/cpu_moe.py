"""A vLLM defect on CPU and its workaround: MoE experts left un-repacked after a weight update."""

from __future__ import annotations

import math
from typing import Any

#: vLLM releases with the defect. In them, an update re-runs an MoE layer's weight processing but skips the
#: CPU experts kernel's own step (its prepacked layout) once the kernel exists, so the experts compute with
#: the new weights in the old layout: silently wrong outputs. tests/core/test_weight_transfer.py fails when
#: a release here no longer has the defect (drop it from the list) or the workaround stops working.
DEFECT_VERSIONS = ("0.32.",)


def has_defect() -> bool:
    """Is the installed vLLM one of `DEFECT_VERSIONS`?"""
    import vllm

    return vllm.__version__.startswith(DEFECT_VERSIONS)


def repack_experts(model: Any) -> int:
    """After a weight update: re-run the CPU experts kernel's layout step on every MoE layer of ``model``
    (what vLLM runs at load). Returns how many layers it repacked."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def why_updates_fail(model_dir: str, tensor_parallel_size: int) -> str | None:
    """Why vLLM's CPU backend could not take weight updates into this model at ``tensor_parallel_size``
    (None: it can). Its CPU experts kernel zero-pads each device's share of the experts' intermediate size to
    its alignment at load, and vLLM's layer-wise reload then fails copying the padded tensors back (the
    engine dies mid-update; docs/scaling.md). Checked before the engine starts, on the releases with it."""
    from transformers import AutoConfig
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts as Experts

    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    if not (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)):
        return None
    field = "moe_intermediate_size" if getattr(config, "moe_intermediate_size", None) else "intermediate_size"
    size = int(getattr(config, field))
    align = math.lcm(Experts.output_alignment, Experts.reduction_alignment)
    if size % tensor_parallel_size == 0 and (size // tensor_parallel_size) % align == 0:
        return None
    return (
        f"{field} {size} over {tensor_parallel_size} device(s) is not a multiple of {align} per device: "
        f"vLLM {DEFECT_VERSIONS[0]}x on CPU pads such experts and then cannot load weight updates into them "
        "(docs/scaling.md); choose a device count that divides it into multiples of it"
    )
