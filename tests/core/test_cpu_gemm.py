"""oneDNN products for the CPU policy: same values and gradients as torch's, and really routed."""

from __future__ import annotations

import copy

import pytest
import torch

from gspo_core import cpu_gemm
from gspo_core import token_logprobs as TL
from gspo_core.config import GSPOConfig
from gspo_core.policy import load_policy

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="this torch has no oneDNN")


def _ops(fn) -> set[str]:
    """Names of the torch ops ``fn()`` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 12), (3, 5, 12)])
def test_linear_values_and_gradients_match_torch(bias, shape):
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(12, 9, bias=bias)
    x = torch.randn(*shape, 12, generator=gen).requires_grad_()
    dy = torch.randn(*shape, 9, generator=gen)
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    ref_grads = torch.autograd.grad(ref, [x, *layer.parameters()], dy)
    assert cpu_gemm.route_linears(layer) == 1
    out = layer(x)
    grads = torch.autograd.grad(out, [x, *layer.parameters()], dy)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_a_frozen_weight_gets_no_gradient_product():
    """LoRA's frozen base layers: no weight gradient; ``sum().backward()`` hands in a 0-stride ``dy``."""
    layer = torch.nn.Linear(8, 6)
    layer.weight.requires_grad_(False)
    x = torch.randn(3, 4, 8, requires_grad=True)
    ref = torch.autograd.grad(torch.nn.functional.linear(x, layer.weight, layer.bias).sum(), [x, layer.bias])
    cpu_gemm.route_linears(layer)
    layer(x).sum().backward()
    assert layer.weight.grad is None
    torch.testing.assert_close(x.grad, ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, ref[1], rtol=1e-5, atol=1e-6)


def test_routed_layers_run_onednn_not_blas():
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    assert "aten::addmm" in _ops(lambda: layer(x))
    cpu_gemm.route_linears(layer)
    ops = _ops(lambda: layer(x))
    assert "mkldnn::_linear_pointwise" in ops and "aten::addmm" not in ops


def test_other_dtypes_and_autocast_go_to_torch():
    layer = torch.nn.Linear(16, 16).double()
    cpu_gemm.route_linears(layer)
    x = torch.randn(4, 16, dtype=torch.float64)
    assert "mkldnn::_linear_pointwise" not in _ops(lambda: layer(x))
    fp32 = torch.nn.Linear(16, 16)
    cpu_gemm.route_linears(fp32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fp32(torch.randn(4, 16)).dtype == torch.bfloat16


def test_mm_matches_matmul_on_transposed_views():
    a, b = torch.randn(40, 24), torch.randn(31, 24)
    torch.testing.assert_close(cpu_gemm.mm(a, b.t()), a @ b.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_gemm.mm(a.t(), a), a.t() @ a, rtol=1e-5, atol=1e-5)
    assert "mkldnn::_linear_pointwise" in _ops(lambda: cpu_gemm.mm(a, b.t()))
    assert cpu_gemm.mm(a.double(), b.double().t()).dtype == torch.float64


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_load_policy_routes_on_cpu_unless_asked_for_blas(tiny_model_dir, lora_rank):
    """The routed policy's loss gradients equal torch's default path's (full and LoRA)."""
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    grads = {}
    for gemm in ("onednn", "blas"):  # (auto is one of them: test_auto_picks_by_cpu_vendor)
        torch.manual_seed(0)  # the same LoRA initialisation for both
        model, _ = load_policy(str(tiny_model_dir), GSPOConfig(lora_rank=lora_rank, cpu_gemm=gemm), torch.device("cpu"))
        linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
        assert all(("forward" in vars(m)) == (gemm == "onednn") for m in linears)
        model(input_ids=ids, labels=ids).loss.backward()
        grads[gemm] = [p.grad for p in model.parameters() if p.requires_grad]
    for a, b in zip(grads["onednn"], grads["blas"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("route", [True, False])
def test_the_fused_head_follows_its_layers_routing(route):
    """The LM head's fused logprobs run oneDNN forward and backward only when its layer was routed
    (``cpu_gemm: blas`` must mean torch's products everywhere)."""
    head = torch.nn.Linear(16, 50, bias=False)
    if route:
        cpu_gemm.route_linears(head)
    h = torch.randn(6, 16, requires_grad=True)
    target = torch.randint(0, 50, (6,))
    ops = _ops(lambda: TL.head_logprobs(h, head, target)[0].sum().backward())
    assert ("mkldnn::_linear_pointwise" in ops) == route
    assert cpu_gemm.routed(head) == route
    assert cpu_gemm.routed(copy.deepcopy(head)) == route  # tests and callers deep-copy policies


@pytest.mark.parametrize("vendor,gemm", [("AuthenticAMD", "onednn"), ("GenuineIntel", "blas"), (None, "blas")])
def test_auto_picks_by_cpu_vendor(tmp_path, vendor, gemm):
    """oneDNN where MKL would run its AVX2 kernels (AMD), MKL elsewhere and where the CPU cannot be read."""
    info = tmp_path / "cpuinfo"
    if vendor:
        info.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: avx2 avx512f\n")
    assert cpu_gemm.preferred(str(info)) == gemm
