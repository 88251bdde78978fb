"""FusedRMSNorm on CUDA (the fused F.rms_norm kernel) against transformers' LlamaRMSNorm.

Both dtype pairs the models run with: bf16 input and weight (bf16 inference), float32 input and weight
under bf16 autocast (training with float32 master weights). Outputs and both gradients, on fresh random
inputs with a spread of row scales (RMSNorm's statistic is per row).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from sparse_llm.model.llama import FusedRMSNorm

pytestmark = pytest.mark.any_cuda  # the dense path too: no sm_90a kernels needed


def norm_pair(width: int, dtype: torch.dtype) -> tuple[LlamaRMSNorm, FusedRMSNorm]:
    stock = LlamaRMSNorm(width, eps=1e-5).to("cuda", dtype)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    fused = LlamaRMSNorm(width, eps=1e-5).to("cuda", dtype)
    fused.load_state_dict(stock.state_dict())
    fused.__class__ = FusedRMSNorm
    return stock, fused


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True)])
@pytest.mark.parametrize("width", [2048, 768])
def test_fused_norm_matches_stock_on_cuda(dtype, autocast, width):
    stock, fused = norm_pair(width, dtype)
    scale_M1 = torch.exp(torch.randn(4096, 1, device="cuda"))  # rows whose RMS spans ~e^-3..e^3
    x = (torch.randn(4096, width, device="cuda") * scale_M1).to(dtype)
    x_stock, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y_stock, y_fused = stock(x_stock), fused(x_fused)
    assert y_fused.dtype == y_stock.dtype
    dy = torch.randn_like(y_stock)
    (y_stock.float() * dy.float()).sum().backward()
    (y_fused.float() * dy.float()).sum().backward()
    if dtype == torch.float32:
        torch.testing.assert_close(y_fused, y_stock, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x_fused.grad, x_stock.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fused.weight.grad, stock.weight.grad, rtol=1e-4, atol=1e-3)
    else:  # one bf16 rounding (fused) against two (stock): within a couple of bf16 ulps
        torch.testing.assert_close(y_fused, y_stock, rtol=2**-7, atol=1e-2)
        torch.testing.assert_close(x_fused.grad, x_stock.grad, rtol=2**-6, atol=2e-2)
        rel = (fused.weight.grad.float() - stock.weight.grad.float()).norm() / stock.weight.grad.float().norm()
        assert rel < 1e-2
