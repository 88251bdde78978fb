"""The GPU tier. Every test in tests/gpu/ is marked `gpu` and needs the sm_90a kernels (an H100 or H200 with CuPy);
without them it is skipped with the reason `sparse_llm.cuda.runtime.unavailable_reason` gives. A module or test marked
`any_cuda` needs a CUDA GPU only (any architecture), and is skipped only where torch sees none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sparse_llm.cuda import runtime

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "any_cuda: in tests/gpu/, runs on any CUDA GPU (not only where the kernels do)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's collection hook sees the whole session's items: only this folder's are touched.
    ours = [item for item in items if HERE in item.path.resolve().parents]
    if not ours:
        return
    kernels_reason = runtime.unavailable_reason()
    no_kernels = None if kernels_reason is None else f"twell kernels unavailable: {kernels_reason}"
    no_cuda = None if torch.cuda.is_available() else "needs a CUDA GPU"
    for item in ours:
        item.add_marker(pytest.mark.gpu)
        reason = no_cuda if item.get_closest_marker("any_cuda") else no_kernels
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
