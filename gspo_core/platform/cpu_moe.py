"""A vLLM defect on CPU and its workaround: MoE experts left un-repacked after a weight update."""

from __future__ import annotations

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
