"""fp32 matrix products on CPU through oneDNN, for the policy's Linear layers and the fused LM head.

torch's fp32 ``matmul``/``linear`` on CPU call MKL, which runs its AVX2 kernels on AMD processors
even where they have AVX-512: on an AMD EPYC (Zen 5, 2 cores) MKL gave 195-230 GFLOPS at the
update's shapes, oneDNN -- the library torch also ships, and the one vLLM's CPU backend uses --
400-490 (docs/bench.md). Each product here runs as oneDNN's ``linear`` (``a @ w.T``), which takes
transposed views as they are, so a backward's ``g @ w`` and ``g.T @ x`` need no copies.

:func:`route_linears` swaps the forward of a model's ``nn.Linear`` layers (LoRA's base layers
included) for :class:`_Linear`; :func:`mm` is ``a @ b`` on the same path, for the fused LM head,
which asks :func:`routed` of its layer. Both fall back to torch where oneDNN does
not apply: off CPU, dtypes other than fp32, under autocast. On Intel CPUs MKL runs its AVX-512 kernels
and is the faster of the two (:func:`preferred`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.cache
def available() -> bool:
    """True when this torch build has oneDNN's fp32 ``linear`` op (every x86 and ARM CPU wheel does)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _applies(*tensors: torch.Tensor) -> bool:
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and not torch.is_autocast_enabled("cpu"))


def _nt(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ w.T (+ b)`` by oneDNN; ``a`` ``[..., K]``, ``w`` ``[N, K]`` (any strides), ``b`` ``[N]``."""
    return torch.ops.mkldnn._linear_pointwise(a, w, b, "none", [], "")


@functools.cache
def preferred(cpuinfo: str = "/proc/cpuinfo") -> str:
    """``cpu_gemm: auto``: "onednn" on AMD CPUs, where MKL runs its AVX2 kernels, else "blas" (on an Intel
    Xeon with AVX-512 the bench's update took 2.32 s with MKL, 2.57 s with oneDNN)."""
    try:
        amd = "AuthenticAMD" in Path(cpuinfo).read_text(errors="replace")
    except OSError:
        amd = False
    return "onednn" if amd else "blas"


def routed(layer: torch.nn.Module) -> bool:
    """True when :func:`route_linears` routed ``layer`` (a deep copy of the model keeps that)."""
    fwd = vars(layer).get("forward")
    return isinstance(fwd, functools.partial) and fwd.func is _forward


def mm(a_MK: torch.Tensor, b_KN: torch.Tensor, onednn: bool = True) -> torch.Tensor:
    """``a_MK @ b_KN`` (2-D), by oneDNN where it applies and ``onednn``, else by torch."""
    if onednn and available() and _applies(a_MK, b_KN) and a_MK.dim() == 2 and b_KN.dim() == 2:
        return _nt(a_MK, b_KN.t())
    return a_MK @ b_KN


class _Linear(torch.autograd.Function):
    """``F.linear`` with its three products by oneDNN: ``y = x w^T + b``, ``dx = dy w``, ``dw = dy^T x``."""

    @staticmethod
    def forward(ctx, x, w_NK, b_N):
        ctx.save_for_backward(x, w_NK)
        ctx.has_bias = b_N is not None
        return _nt(x, w_NK, b_N)

    @staticmethod
    def backward(ctx, dy):
        x, w_NK = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        dy_MN = dy.reshape(-1, dy.size(-1))
        dx = _nt(dy, w_NK.t()) if need_x else None
        dw = _nt(dy_MN.t(), x.reshape(-1, x.size(-1)).t()) if need_w else None
        db = dy_MN.sum(0) if need_b and ctx.has_bias else None
        return dx, dw, db


def _forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = layer.bias
    if _applies(x, layer.weight, *(() if bias is None else (bias,))):
        return _Linear.apply(x, layer.weight, bias)
    return torch.nn.functional.linear(x, layer.weight, bias)


def route_linears(model: torch.nn.Module) -> int:
    """Run every ``nn.Linear`` of ``model`` through :class:`_Linear` (checked per call: a layer moved
    to a GPU or cast to bf16 goes back to ``F.linear``). Returns how many layers were routed; 0 where
    this torch has no oneDNN."""
    if not available():
        return 0
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    for layer in layers:
        layer.forward = functools.partial(_forward, layer)
    return len(layers)
