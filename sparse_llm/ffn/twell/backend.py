"""`TwellFFN`, the "twell" backend: the sparse kernels behind the `FFNBackend` interface.

Inference calls go to `infer_op.twell_gated_mlp`, training calls to `train_op.twell_train_ffn`; the prices that
dispatch compares come from `cost_model`. The backend imports without a GPU or CuPy and says, per call, why it
cannot run where it cannot.
"""

from __future__ import annotations

import warnings

import torch

from sparse_llm.cuda import runtime
from sparse_llm.ffn.backend import FFNBackend
from sparse_llm.ffn.torch_backend import TorchFFN, with_residual
from sparse_llm.ffn.twell.cost_model import train_estimated_ms, twell_estimated_ms
from sparse_llm.ffn.twell.infer_op import twell_gated_mlp
from sparse_llm.ffn.twell.train_op import twell_train_ffn
from sparse_llm.ffn.twell.validation import shape_unsupported_reason


def _bf16_autocast(device_type: str) -> bool:
    """Whether bf16 autocast is on for ``device_type`` (then dense GEMMs would run in bf16 too)."""
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.bfloat16


class TwellFFN(FFNBackend):
    """Inference through the TwELL kernels on Hopper GPUs (sm_90a) with bf16 tensors.

    Under bf16 autocast (e.g. validation of fp32 weights during training) the tensors are cast to bf16
    first, as autocast casts the dense GEMMs' inputs. Otherwise non-bf16 inference tensors are an error,
    not a silent dense fallback: `kernel=twell` promises the sparse kernels, and `kernel=auto` never sends
    them here (`accepts`). Where the GPU cannot run the kernels (CPU, other GPUs) a direct call runs the
    torch path instead, with one warning per reason and a `path` that says so; the dispatcher refuses a
    forced `kernel=twell` there before calling. Training casts under autocast (sparse_llm/ffn/twell/train_op.py).
    """

    name = "twell"

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def unavailable_reason(self, device: torch.device) -> str | None:
        return runtime.unavailable_reason(device)

    def accepts(self, x_MK: torch.Tensor, w_gate_NK: torch.Tensor, training: bool) -> bool:
        """Inference takes bf16 tokens and weights, or any under bf16 autocast; training casts by itself."""
        bf16 = x_MK.dtype == w_gate_NK.dtype == torch.bfloat16
        return training or bf16 or _bf16_autocast(x_MK.device.type)

    def forward(
        self,
        x_MK,
        w_gate_NK,
        w_up_NK,
        w_down_KN,
        *,
        training,
        statistics=True,
        compile_backend=None,
        residual_MK=None,
        residual_writable=False,
        l0=None,
        tail=None,
        output_norm=None,
    ):
        # The kernels add the residual as they write a fresh y: residual_writable only serves the torch fallback.
        if training:
            result = twell_train_ffn(x_MK, w_gate_NK, w_up_NK, w_down_KN, l0_hint=l0, tail=tail)
            return with_residual(result, residual_MK)
        reason = self.unavailable_reason(x_MK.device)
        if reason is not None:
            if reason not in self._warned:
                warnings.warn(f"twell kernels not used ({reason}); using the dense torch path.", stacklevel=2)
                self._warned.add(reason)
            result = TorchFFN().forward(
                x_MK,
                w_gate_NK,
                w_up_NK,
                w_down_KN,
                training=False,
                statistics=statistics,
                residual_MK=residual_MK,
                residual_writable=residual_writable,
            )
            result.path = "torch (twell unavailable)"
            return result
        if _bf16_autocast(x_MK.device.type):
            x_MK, w_gate_NK, w_up_NK, w_down_KN = (t.to(torch.bfloat16) for t in (x_MK, w_gate_NK, w_up_NK, w_down_KN))
        weights = (w_gate_NK, w_up_NK, w_down_KN)
        if x_MK.dtype != torch.bfloat16 or any(w.dtype != torch.bfloat16 for w in weights):
            weight_dtypes = "/".join(sorted({str(w.dtype).removeprefix("torch.") for w in weights}))
            raise ValueError(
                f"kernel=twell: the TwELL inference kernels take bf16 tensors, got x "
                f"{str(x_MK.dtype).removeprefix('torch.')} and weights {weight_dtypes}. Load the model with "
                "dtype=bfloat16, or use kernel=auto (which runs such layers on the torch path)."
            )
        return twell_gated_mlp(
            x_MK,
            w_gate_NK,
            w_up_NK,
            w_down_KN,
            residual_MK=residual_MK,
            l0_hint=l0,
            statistics=statistics,
            tail=tail,
            output_norm=output_norm,
        )

    def estimated_ms(self, m, k, n, l0_mean, l0_max, training, compiled=False, tail=None):
        if shape_unsupported_reason(k, n) is not None:  # (the kernels are the same whether the layer is compiled)
            return None
        if training:
            return train_estimated_ms(m, k, n, l0_mean, l0_max)
        return twell_estimated_ms(m, k, n, l0_mean, l0_max, tail)
