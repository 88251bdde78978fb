"""CPU-side tests of the twell backend: kernel sources, input validation, cost model, fallbacks.

The .cu files are compiled with nvcc for sm_90a when nvcc is on PATH (or in /usr/local/cuda/bin),
exactly as NVRTC sees them (local headers inlined); no GPU is needed for that.
"""

from __future__ import annotations

import re
import subprocess
import threading
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import background
from helpers.nvcc import NVCC, build_for_sm90a

from sparse_llm import doctor
from sparse_llm.cuda import runtime as cuda
from sparse_llm.cuda import tensor_map
from sparse_llm.ffn import kernel_set
from sparse_llm.ffn.backend import Tail
from sparse_llm.ffn.registry import get_backend
from sparse_llm.ffn.torch_backend import TorchFFN
from sparse_llm.ffn.twell import backend as twell_backend
from sparse_llm.ffn.twell import cost_model, infer_launch, infer_op
from sparse_llm.ffn.twell.backend import TwellFFN
from sparse_llm.ffn.twell.cost_model import (
    CUBLAS_GEMM_TFLOPS,
    SLICES_MIN_M,
    column_parts,
    dense_ms,
    dense_row_split,
    direct_walk,
    heavy_share,
    row_slowdown,
    rows_walk_ms,
    slice_width,
    slices_walk_ms,
    twell_estimated_ms,
)
from sparse_llm.ffn.twell.infer_launch import TransposeCache, dense_row_stats, direct_up_down, flagged_parts
from sparse_llm.ffn.twell.synthetic import synthetic_block
from sparse_llm.ffn.twell.validation import check_inputs
from sparse_llm.model.llama import ModelConfig, build_model

KERNEL_FILES = (
    "twell_gate_wgmma.cu",
    "gate_up_down.cu",
    "gate_up_then_down.cu",
    "transpose.cu",
    "rope.cu",
    "dense_rows.cu",
    "decode_ffn.cu",
)


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


def block(m: int = 4, k: int = 128, n: int = 512) -> list[torch.Tensor]:
    return [bf16(m, k), bf16(n, k), bf16(n, k), bf16(k, n)]


# ---------------------------------------------------------------- sources and compilation


@pytest.mark.parametrize("filename", KERNEL_FILES)
def test_kernel_sources_are_found_and_self_contained(filename):
    source = cuda.kernel_source(filename)
    assert '#include "' not in source  # local headers inlined, so CuPy's cache key covers them
    assert "TWELL_CAPACITY" in source


def test_missing_kernel_names_the_places_tried():
    with pytest.raises(FileNotFoundError, match="_kernels"):
        cuda.kernel_path("no_such_kernel.cu")


@background.offer("sm90a_builds")
def _compile_kernels_for_sm90a() -> dict[str, subprocess.CompletedProcess]:
    # ~20 s: done while other tests run
    return build_for_sm90a(KERNEL_FILES)


@pytest.fixture(scope="module")
def sm90a_builds() -> dict[str, subprocess.CompletedProcess]:
    return background.result("sm90a_builds")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("filename", KERNEL_FILES)
def test_kernels_compile_for_sm90a(filename, sm90a_builds):
    done = sm90a_builds[filename]
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("filename, name", doctor.KERNELS)
def test_doctor_compiles_kernels_that_exist(filename, name):
    """Each kernel the doctor compile-checks is defined in its file, templated ones with that instantiation."""
    source = cuda.kernel_source(filename)
    base, _, args = name.partition("<")
    # attributes such as __cluster_dims__(...) and __launch_bounds__(...), which may hold one level of parentheses
    attributes = r"(?: __\w+__\((?:[^()]|\([^()]*\))*\))*"
    assert re.search(rf"__global__ void{attributes} {base}\(", source), name
    if args:  # explicit instantiation, written out or through a macro call such as TRAIN_CSC_WGRAD(8, 1)
        compact = source.replace(" ", "")
        assert f"{name}(" in compact or f"({args.rstrip('>')})" in compact, f"{name} is not instantiated"


def test_doctor_covers_the_training_kernels_and_passes_without_a_gpu(capsys):
    assert {filename for filename, _ in doctor.KERNELS} >= {"train_forward.cu", "train_backward.cu"}
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert doctor.main() == 0
    assert "train_backward.cu" in capsys.readouterr().out


def test_precompile_runs_the_children_side_by_side_and_reports_each_kernel(monkeypatch):
    """Kernels compile in child processes several at a time; a failure is reported for its kernel and the others
    still compile."""
    monkeypatch.delenv("SPARSE_LLM_COMPILE_INPROCESS", raising=False)
    together = threading.Barrier(2, timeout=60)  # k0 and k1 each wait for the other: only side by side do they pass

    def fake_child(filename: str, name: str) -> None:
        if name in ("k0", "k1"):
            together.wait()
        if name == "broken":
            raise RuntimeError("nvrtc said no")

    monkeypatch.setattr(cuda, "_compile_in_child", fake_child)
    kernels = [("a.cu", f"k{i}") for i in range(6)] + [("b.cu", "broken")]
    finished = []
    failed = cuda.precompile(kernels, workers=4, done=lambda f, n, e: finished.append((f, n, e is None)))
    assert set(failed) == {("b.cu", "broken")} and "nvrtc said no" in str(failed["b.cu", "broken"])
    assert sorted(finished) == sorted((f, n, n != "broken") for f, n in kernels)

    monkeypatch.setenv("SPARSE_LLM_COMPILE_INPROCESS", "1")  # compiled by get_function in this process instead
    assert cuda.precompile(kernels, done=lambda *_: finished.append("called")) == {} and "called" not in finished


def tiny_model(kernel: str) -> torch.nn.Module:
    config = ModelConfig(hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=4, vocab_size=64)
    return build_model(config, kernel=kernel)


def test_model_kernels_follow_the_layers_backend():
    rope = list(kernel_set.ROPE_KERNELS)
    inference, training = kernel_set.inference_kernels(512, 1024), kernel_set.training_kernels(512, 1024)
    assert ("gate_up_down.cu", "gate_up_down_light<2,true>") in inference  # K = 512: two 16-byte pieces a lane
    assert kernel_set.model_kernels(tiny_model("torch"), training=True) == rope  # the rotary kernel runs anyway
    auto = tiny_model("auto")
    assert kernel_set.model_kernels(auto, training=False) == list(dict.fromkeys(rope + inference))
    with_training = list(dict.fromkeys(rope + inference + training))
    assert kernel_set.model_kernels(auto, training=True) == with_training  # its layers switch once sparse
    assert kernel_set.model_kernels(tiny_model("twell"), training=True) == with_training
    narrow = build_model(ModelConfig(hidden_size=96, intermediate_size=256, num_layers=1, num_heads=2, vocab_size=64))
    assert kernel_set.model_kernels(narrow, training=False) == rope  # K = 96: no kernel takes the layer


def test_warm_compiles_only_what_the_cache_lacks_and_names_failures(monkeypatch, caplog):
    monkeypatch.delenv("SPARSE_LLM_COMPILE_INPROCESS", raising=False)
    monkeypatch.setattr(cuda, "unavailable_reason", lambda device=None: None)  # as on a Hopper GPU
    monkeypatch.setattr(cuda, "is_compiled", lambda filename, name: filename == "rope.cu")
    asked: list[list[tuple[str, str]]] = []

    def fake_precompile(kernels):
        asked.append(list(kernels))
        return {("dense_rows.cu", "dense_rows_h"): RuntimeError("nvrtc said no")}

    monkeypatch.setattr(cuda, "precompile", fake_precompile)
    model = tiny_model("auto")
    with caplog.at_level("INFO", logger="sparse_llm.ffn.kernel_set"):
        kernel_set.warm(model, torch.device("cuda"), training=False)
    assert asked == [kernel_set.inference_kernels(512, 1024)]
    assert "dense_rows_h" in caplog.text and "nvrtc said no" in caplog.text
    assert f"Compiled {len(asked[0]) - 1} CUDA kernels" in caplog.text

    kernel_set.warm(model, torch.device("cpu"), training=False)  # no kernels off the GPU
    monkeypatch.setattr(cuda, "is_compiled", lambda filename, name: True)
    kernel_set.warm(model, torch.device("cuda"), training=False)  # all cached
    monkeypatch.setattr(cuda, "is_compiled", lambda filename, name: False)
    monkeypatch.setenv("SPARSE_LLM_COMPILE_INPROCESS", "1")  # each compiles in this process on first use
    kernel_set.warm(model, torch.device("cuda"), training=False)
    assert len(asked) == 1


def test_import_is_safe_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert "CUDA" in cuda.unavailable_reason()
    assert get_backend("twell").unavailable_reason(torch.device("cpu")) is not None


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "mutate, name",
    [
        (lambda a: a.__setitem__(0, a[0].float()), "x_MK"),
        (lambda a: a.__setitem__(0, a[0][None]), "x_MK"),
        (lambda a: a.__setitem__(1, a[1][:, :64]), "w_gate_NK"),
        (lambda a: a.__setitem__(2, a[2][:256]), "w_up_NK"),
        (lambda a: a.__setitem__(3, a[3].t().contiguous()), "w_down_KN"),
        (lambda a: a.__setitem__(2, a[2].t().contiguous().t()), "w_up_NK"),
        (lambda a: a.__setitem__(3, a[3].half()), "w_down_KN"),
    ],
)
def test_bad_inputs_name_the_argument(mutate, name):
    args = block()
    mutate(args)
    with pytest.raises((TypeError, ValueError), match=name):
        check_inputs(*args)


@pytest.mark.parametrize(
    "k, n, what", [(96, 512, "multiple of 64"), (128, 384, "multiple of 256"), (8192, 256, "exceeds")]
)
def test_unsupported_widths_are_rejected(k, n, what):
    with pytest.raises(ValueError, match=what):
        check_inputs(*block(2, k, n))


def test_cpu_tensors_are_rejected_with_a_fix():
    with pytest.raises(ValueError, match="kernel=torch"):
        check_inputs(*block())


@pytest.mark.parametrize(
    "mutate, name",
    [
        (lambda a: a.__setitem__(1, a[1][:2]), "gate_MN"),  # one gate row per token
        (lambda a: a.__setitem__(1, a[1].float()), "gate_MN"),
        (lambda a: a.__setitem__(1, a[1][0]), "gate_MN"),
        (lambda a: a.__setitem__(3, a[3].t()), "w_down_t_NK"),  # [K, N] given where [N, K] is expected
        (lambda a: a.__setitem__(2, a[2][:, :64]), "w_up_NK"),
    ],
)
def test_direct_up_down_names_a_bad_argument(mutate, name):
    x_MK, w_gate_NK, w_up_NK, w_down_KN = block()
    args = [x_MK, x_MK @ w_gate_NK.t(), w_up_NK, w_down_KN.t().contiguous()]
    mutate(args)
    with pytest.raises((TypeError, ValueError), match=name):
        direct_up_down(*args)
    with pytest.raises(ValueError, match="kernel=torch"):  # well-formed CPU operands: the kernels need CUDA
        direct_up_down(x_MK, x_MK @ w_gate_NK.t(), w_up_NK, w_down_KN.t().contiguous())


# ---------------------------------------------------------------- cost model and dispatch


def test_cost_model_declines_unsupported_shapes():
    backend = TwellFFN()
    assert backend.estimated_ms(16384, 2000, 5632, 28, 50, training=True) is None
    assert backend.estimated_ms(16384, 2000, 5632, 28, 50, training=False) is None
    assert backend.estimated_ms(16384, 2048, 5600, 28, 50, training=False) is None


def test_cost_model_grows_with_density_and_tail():
    times = [twell_estimated_ms(16384, 2048, 5632, l0, 1.5 * l0) for l0 in (28, 56, 112)]
    assert times == sorted(times) and times[-1] > 1.5 * times[0]
    # Once every token goes dense, the call costs the gate plus the dense block.
    assert twell_estimated_ms(16384, 2048, 5632, 560, 700) > dense_ms(16384, 2048, 5632)


def test_dispatch_picks_sparse_only_where_it_pays():
    """At the paper's shapes: sparse at 28 and 56 non-zeros per token (measured 1.37-1.54x and 1.09x dense on the
    H100) and with a heavy tail at 28 (its heavy tokens through the dense rows: 1.57x on an H200, 2026-11-26); dense
    at 560 (10%) and with a heavy tail at 112. For decode sizes the decode kernel up to a few tokens (in CUDA graphs
    2.5x dense at 1 token, 2.1x at 4, 1.5x at 8, 1.4x at 16 with the gates on the tensor cores, 2026-11-26), dense
    beyond, and for a token that fires every neuron."""
    sparse, dense = TwellFFN(), TorchFFN()
    m, k, n = 16384, 2048, 5632
    assert sparse.estimated_ms(m, k, n, 28, 56, False) < 0.95 * dense.estimated_ms(m, k, n, 28, 56, False)
    assert sparse.estimated_ms(m, k, n, 56, 101, False) < 0.95 * dense.estimated_ms(m, k, n, 56, 101, False)
    assert sparse.estimated_ms(m, k, n, 28, 1353, False) < 0.95 * dense.estimated_ms(m, k, n, 28, 1353, False)
    assert sparse.estimated_ms(m, k, n, 112, 2028, False) > dense.estimated_ms(m, k, n, 112, 2028, False)
    assert sparse.estimated_ms(m, k, n, 560, 700, False) > dense.estimated_ms(m, k, n, 560, 700, False)
    for tokens in (1, 4, 8, 16):
        assert sparse.estimated_ms(tokens, k, n, 28, 28, False) < 0.95 * dense.estimated_ms(tokens, k, n, 28, 28, False)
    for tokens in (1, 8):
        assert sparse.estimated_ms(tokens, k, n, n, n, False) > dense.estimated_ms(tokens, k, n, n, n, False)
    assert sparse.estimated_ms(64, k, n, 28, 28, False) > dense.estimated_ms(64, k, n, 28, 28, False)


# The decode kernel in CUDA graphs at K x N = 2048 x 5632 (H200, 2026-11-29): (tokens, non-zeros per token, us), the
# tokens past 16 in groups of 16 whose blocks run side by side.
MEASURED_DECODES = [
    (16, 28, 27.2),
    (32, 28, 30.1),
    (48, 28, 36.4),
    (64, 28, 43.8),
    (16, 56, 31.8),
    (32, 56, 36.9),
    (48, 56, 45.8),
    (64, 56, 56.7),
]


@pytest.mark.parametrize("m, l0, us", MEASURED_DECODES)
def test_decode_price_follows_its_groups(m, l0, us):
    """The decode kernel's price is 0.9-1.2x its measured time, from one group of tokens to four (priced one after
    another, four groups would cost 2.3x the measured time at 64 tokens)."""
    assert 0.9 * us <= 1e3 * cost_model.decode_ms(m, 2048, 5632, l0, 2 * l0) <= 1.2 * us


# The direct route's walk on the H100 (2026-11-26, docs/benchmarks.md), in the column parts `column_parts` gives at that
# density (one pass at 44 MiB of rows, two from 66 to 224, three from 128 at 56 non-zeros, which the price takes
# for two): (M, K, N, non-zeros per token, ms).
MEASURED_WALKS = [
    (16384, 2048, 5632, 28.0, 0.613),
    (16384, 2048, 5632, 56.2, 1.087),
    (16384, 2048, 8448, 27.8, 0.724),
    (16384, 2048, 8448, 57.4, 1.183),
    (16384, 2048, 11264, 27.7, 0.839),
    (16384, 2048, 11264, 56.1, 1.303),
    (16384, 2048, 16896, 28.1, 1.133),
    (16384, 2048, 16896, 55.6, 1.518),
    (16384, 3072, 8192, 28.2, 1.285),
    (16384, 3072, 8192, 55.6, 2.018),
    (8192, 4096, 5632, 28.1, 0.788),
    (8192, 4096, 5632, 56.2, 1.265),
    (8192, 4096, 11008, 20.3, 0.899),
    (8192, 4096, 11008, 57.4, 1.719),
    (16384, 4096, 11008, 28.5, 2.206),
    (16384, 4096, 11008, 57.4, 3.413),
    (8192, 4096, 14336, 20.5, 0.992),
    (8192, 4096, 14336, 57.0, 1.959),
]


@pytest.mark.parametrize("m, k, n, l0, walk_ms", MEASURED_WALKS)
def test_cost_model_prices_walks_whose_rows_outgrow_l2(m, k, n, l0, walk_ms):
    """The walk's price (the call's minus its gate GEMM) is 0.95-1.4x the measured time, from blocks whose rows fit
    L2 to ones five times larger (a price at the L2 rate had been 0.6x the one-pass time at the widest)."""
    assert 0.95 * walk_ms <= rows_walk_ms(m, k, n, l0, 2 * l0) <= 1.4 * walk_ms


def test_dispatch_on_wide_blocks_follows_the_walks():
    """K = 4096, N = 11008 (172 MiB of w_up + w_down rows) on the H100: the "rows" walk reads its rows from HBM and lost
    to dense from ~60 non-zeros per token (8.23 vs 6.39 ms at 82, scripts/bench_mlp.py, 2026-11-26); the "slices"
    walk reads only w_up's rows and took 3.57 ms past the gate GEMM at 82 (5.62 ms in all back to back, dense 6.65).
    With a heavy tail (mean 114 / max 169: 0.17 of the non-zeros above 128) the route is rows, which loses: dense."""
    sparse, dense = TwellFFN(), TorchFFN()
    m, k, n = 16384, 4096, 11008
    assert sparse.estimated_ms(m, k, n, 28, 45, False) < 0.95 * dense.estimated_ms(m, k, n, 28, 45, False)
    assert sparse.estimated_ms(m, k, n, 80, 120, False) < 0.95 * dense.estimated_ms(m, k, n, 80, 120, False)
    assert sparse.estimated_ms(m, k, n, 114, 169, False) > dense.estimated_ms(m, k, n, 114, 169, False)
    assert row_slowdown(4 * 2048 * 5632) == 1.0  # the paper's block (two bf16 rows of K per neuron) stays in L2
    assert row_slowdown(4 * 4096 * 11008) > 2.0


# The "slices" walk (2026-11-26, docs/benchmarks.md): (M, K, N, mean and max non-zeros per token, ms). The first three
# on an H200 with the tokens ordered by count; the rest on an H100 before that (the 8-column ones not re-measured
# since).
MEASURED_SLICES = [
    (16384, 2048, 5632, 28.0, 52, 0.598),
    (16384, 2048, 5632, 56.0, 91, 0.932),
    (8192, 2048, 5632, 55.9, 93, 0.516),
    (32768, 2048, 5632, 28.1, 55, 1.137),
    (16384, 2048, 11264, 27.8, 58, 0.892),
    (16384, 2048, 11264, 79.8, 129, 1.575),
    (16384, 3072, 8192, 28.3, 56, 1.131),
    (16384, 4096, 11008, 28.5, 57, 1.828),
    (16384, 4096, 11008, 57.3, 95, 2.689),
    (16384, 4096, 11008, 81.5, 125, 3.573),
    (8192, 4096, 14336, 20.4, 41, 1.046),
    (8192, 4096, 14336, 56.8, 96, 1.666),
]


@pytest.mark.parametrize("m, k, n, l0_mean, l0_max, walk_ms", MEASURED_SLICES)
def test_slices_price_follows_the_measured_walks(m, k, n, l0_mean, l0_max, walk_ms):
    assert 0.85 * walk_ms <= slices_walk_ms(m, k, n, l0_mean, l0_max) <= 1.2 * walk_ms


def test_direct_walk_takes_slices_only_where_they_pay():
    """Slices for many tokens with evenly spread non-zeros (measured 0.91-0.96x the rows walk's time at the paper's
    block); rows without a density, with a heavy tail (slices tie at best), below SLICES_MIN_M tokens, and where no
    slice fits shared memory."""
    assert direct_walk(16384, 2048, 5632, (28, 52)) == direct_walk(16384, 2048, 5632, (56, 91)) == "slices"
    assert direct_walk(16384, 2048, 5632, None) == "rows"
    assert direct_walk(16384, 2048, 5632, (28, 1353)) == "rows"
    assert direct_walk(SLICES_MIN_M - 1, 2048, 5632, (28, 52)) == "rows"
    assert direct_walk(16384, 4096, 16896, (28, 52)) == "rows" and slices_walk_ms(16384, 4096, 16896, 28, 52) is None
    assert (slice_width(5632), slice_width(11264), slice_width(14336), slice_width(16896)) == (16, 8, 8, None)


def test_walk_choice_comes_from_the_environment(monkeypatch):
    """Measured by default; SPARSE_LLM_TWELL_WALK=priced trusts the price; anything else is named as an error."""
    monkeypatch.delenv(infer_op.WALK_CHOICE_ENV, raising=False)
    assert infer_op.walk_choice() == "measured"
    monkeypatch.setenv(infer_op.WALK_CHOICE_ENV, "priced")
    assert infer_op.walk_choice() == "priced"
    monkeypatch.setenv(infer_op.WALK_CHOICE_ENV, "fastest")
    with pytest.raises(ValueError, match="SPARSE_LLM_TWELL_WALK='fastest' is not valid"):
        infer_op.walk_choice()


def test_walk_trials_are_shared_by_close_densities_only():
    """Layers whose mean non-zeros differ by less than a bucket (2 ** 0.5) share a trial."""
    bucket = infer_op._mean_bucket
    assert bucket(24.0) == bucket(26.0) != bucket(56.0) and bucket(0.0) == bucket(1.0) == 0


BF16 = torch.bfloat16


@pytest.mark.parametrize(
    "weight_K, out_MK, walk, message",
    [
        (torch.ones(64), torch.zeros(4, 64, dtype=BF16), "rows", "norm.weight_K has dtype torch.float32"),
        (torch.ones(32, dtype=BF16), torch.zeros(4, 64, dtype=BF16), "rows", r"norm.weight_K has shape \(32,\)"),
        (torch.ones(64, dtype=BF16), torch.zeros(64, 4, dtype=BF16), "rows", r"norm.out_MK has shape \(64, 4\)"),
        (torch.ones(64, dtype=BF16), torch.zeros(4, 64, dtype=BF16), "slices", "only walk='rows' can norm it"),
    ],
)
def test_direct_up_down_names_a_bad_output_norm(weight_K, out_MK, walk, message):
    x = torch.zeros(4, 64, dtype=BF16)
    norm = infer_launch.OutputNorm(weight_K, 1e-5, out_MK)
    with pytest.raises((TypeError, ValueError), match=message):
        direct_up_down(x, torch.zeros(4, 256, dtype=BF16), x, x, walk=walk, norm=norm)


def test_direct_up_down_names_a_bad_walk():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="walk='diagonal' is not valid"):
        direct_up_down(x, torch.zeros(4, 256, dtype=torch.bfloat16), x, x, walk="diagonal")


def test_tail_price_grows_with_the_share_of_non_zeros_in_the_tail():
    """The heavy-tail factor follows the share of the non-zeros in tokens above DENSE_ROW_NNZ, not a step at it: at
    K = 2048, N = 11264 a layer of mean 80 / max 142 (a few tokens just over 128) ran in 2.76 ms against dense 3.53
    (H100, 2026-11-26) but was priced with the whole factor (4.7 ms) and kept dense; heavy tails keep the factor
    (mean 28 / max 1353 at the paper's block took 1.79 ms, priced 1.84; its heavy tokens now go to the dense rows:
    `test_heavy_tails_are_priced_from_their_measured_shares`). At K = 4096, N = 11008 a mean 82 / max
    142 layer took 0.86x dense's speed through the rows walk, whose price stays above dense; its tail is mild enough
    for the slices walk, which wins (1.15x dense at mean 82 / max 125)."""
    sparse, dense = TwellFFN(), TorchFFN()
    m = 16384
    assert sparse.estimated_ms(m, 2048, 11264, 80, 142, False) < 0.95 * dense.estimated_ms(
        m, 2048, 11264, 80, 142, False
    )
    gate_ms = 2.0 * m * 4096 * 11008 / (CUBLAS_GEMM_TFLOPS * 1e9)
    assert gate_ms + rows_walk_ms(m, 4096, 11008, 82, 142) > dense.estimated_ms(m, 4096, 11008, 82, 142, False)
    assert direct_walk(m, 4096, 11008, (82, 142)) == "slices"
    assert sparse.estimated_ms(m, 4096, 11008, 82, 142, False) < 0.95 * dense.estimated_ms(
        m, 4096, 11008, 82, 142, False
    )
    at, over = twell_estimated_ms(m, 2048, 5632, 80, 128), twell_estimated_ms(m, 2048, 5632, 80, 131)
    assert at <= over < 1.02 * at  # no step at the threshold
    assert heavy_share(28, 100) == 0.0 and 0.1 < heavy_share(28, 1353) < 0.3 < heavy_share(112, 1788) < 1.0


# Heavy tails at the paper's block, M = 16384 (scripts/bench_mlp.py, H100, 2026-11-26, two runs; sigma 0.3 / 0.5): mean
# and max non-zeros per token, the heavy tokens' shares of tokens and non-zeros, the measured calls in ms (dense:
# 1.74-1.86).
MEASURED_TAILS = [
    (28.2, 796, 0.0571, 0.475, (1.244, 1.269)),
    (56.0, 990, 0.138, 0.626, (1.507, 1.485)),
    (111.5, 1192, 0.295, 0.774, (1.774, 1.824)),
    (28.4, 1353, 0.0628, 0.725, (1.139, 1.117)),
    (56.1, 1556, 0.126, 0.803, (1.288, 1.306)),
    (112.1, 1788, 0.237, 0.870, (1.510, 1.580)),
    (279.5, 2083, 0.489, 0.943, (1.929, 1.957)),
]


@pytest.mark.parametrize("l0_mean, l0_max, tokens, nonzeros, calls_ms", MEASURED_TAILS)
def test_heavy_tails_are_priced_from_their_measured_shares(l0_mean, l0_max, tokens, nonzeros, calls_ms):
    """With the heavy tokens' measured shares the price lands within 0.97x of the slower and 1.05x of the faster
    measured call (these tails hold 47-94% of their non-zeros on heavy tokens, which the log-normal model puts at
    20-60%:
    without the shares the price is up to 1.6x the call, which keeps such layers dense)."""
    m, k, n = 16384, 2048, 5632
    priced = twell_estimated_ms(m, k, n, l0_mean, l0_max, Tail(tokens, nonzeros))
    assert 0.97 * max(calls_ms) <= priced <= 1.05 * min(calls_ms)
    assert twell_estimated_ms(m, k, n, l0_mean, l0_max) >= priced


def test_dense_rows_are_reserved_from_the_measured_share_of_heavy_tokens():
    """The direct route's dense rows: 1.25x the heavy tokens a measured share expects plus 128, in multiples of 128;
    twice the log-normal model's count without one; none without a hint, a token above the threshold, or below
    SPLIT_BELOW_M tokens (every token is split over warps there); never more than M."""
    capacity = cost_model.dense_row_capacity
    assert capacity(16384, (28.4, 1793), tail=Tail(1022 / 16384, 0.5)) == 1408  # 1.25 * 1022 + 128 = 1405.5
    assert capacity(16384, (28.4, 1793)) == 1152  # the model expects ~512
    # a share measured at 128 says nothing at another threshold
    modelled_at_96 = capacity(16384, (28.4, 1793), split_nnz=96)
    assert capacity(16384, (28.4, 1793), split_nnz=96, tail=Tail(0.5, 0.9)) == modelled_at_96
    assert capacity(16384, None) == capacity(16384, (28.0, 128.0)) == capacity(2047, (28.4, 1793)) == 0
    assert capacity(4096, (500.0, 900.0), tail=Tail(1.0, 1.0)) == 4096


def test_column_parts():
    """Blocks whose w_up + w_down rows fit L2 are walked in one pass, wider ones in two (three for the widest at a
    known density of 45 non-zeros per token or more); parts are tile-aligned and cover every column once."""
    assert column_parts(2048, 5632) == [(0, 5632)]  # 44 MiB of rows: the paper's block
    assert column_parts(2048, 11264) == [(0, 5632), (5632, 11264)]
    assert column_parts(4096, 14336) == [(0, 7168), (7168, 14336)]
    assert column_parts(4096, 14336, l0_mean=28) == column_parts(4096, 14336)
    assert len(column_parts(4096, 14336, l0_mean=56)) == 3  # denser layers of blocks beyond 128 MiB of rows
    assert len(column_parts(2048, 11264, l0_mean=56)) == 2  # 88 MiB
    assert column_parts(1024, 3072, parts=3) == [(0, 1024), (1024, 2048), (2048, 3072)]
    assert column_parts(256, 512, parts=2) == [(0, 256), (256, 512)]
    with pytest.raises(ValueError, match="parts=3"):
        column_parts(256, 512, parts=3)
    # the kernels' FIRST_PART / LAST_PART flags: one pass is both, the middle of three neither
    assert flagged_parts([(0, 5632)]) == [((0, 5632), 3)]
    assert [flags for _, flags in flagged_parts(column_parts(2048, 5632, parts=3))] == [1, 0, 2]


def test_dense_row_split():
    assert dense_row_split(22, 28, 100) == (0.0, 28)  # no token can exceed the dense-row threshold
    light, heavy = dense_row_split(22, 60, 300), dense_row_split(22, 60, 1500)
    assert 0.0 < light[0] < heavy[0] < 1.0
    assert heavy[1] < light[1] < 60  # the tokens left sparse are the lighter ones
    assert dense_ms(16384, 2048, 5632) > dense_ms(16, 2048, 5632) > 0


def test_mappable_matches_what_a_tensor_map_accepts():
    """The fused gate's fallback (`_direct_gate`) and `bf16_box_map` share one rule: contiguous bf16, 16-byte
    aligned, rows a multiple of 16 bytes."""
    base = torch.zeros(64, 72, dtype=torch.bfloat16)
    assert tensor_map.mappable(base)
    rejected = {
        "fp32": base.float(),
        "transposed": base.t(),
        "misaligned": base.view(-1)[1 : 1 + 64 * 64].view(64, 64),
        "odd rows": torch.zeros(64, 12, dtype=torch.bfloat16),
    }
    for name, t in rejected.items():
        assert not tensor_map.mappable(t), name
        with pytest.raises(ValueError, match="a tensor map needs"):
            tensor_map.bf16_box_map(t, 64)


# ---------------------------------------------------------------- backend behaviour


def test_training_goes_to_the_sparse_training_op():
    args = [t.float().requires_grad_() for t in block()]
    result = TwellFFN().forward(*args, training=True)
    assert result.path.startswith("twell-train")
    torch.testing.assert_close(result.y_MK, TorchFFN().forward(*args, training=True).y_MK, rtol=1e-4, atol=1e-5)
    result.y_MK.sum().backward()
    assert all(t.grad is not None for t in args)


@pytest.mark.parametrize("statistics", [True, False])
def test_inference_asks_the_kernels_for_statistics_only_when_the_layer_does(monkeypatch, statistics):
    calls = []
    monkeypatch.setattr(TwellFFN, "unavailable_reason", lambda self, device: None)
    monkeypatch.setattr(twell_backend, "twell_gated_mlp", lambda *args, **kwargs: calls.append(kwargs))
    TwellFFN().forward(*block(), training=False, statistics=statistics)
    assert calls[0]["statistics"] is statistics


def test_cpu_falls_back_to_torch_with_one_warning():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    backend, args = TwellFFN(), block()
    with pytest.warns(UserWarning, match="dense torch path"):
        result = backend.forward(*args, training=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend.forward(*args, training=False)  # warned once only
    assert result.path == "torch (twell unavailable)"
    torch.testing.assert_close(result.y_MK, TorchFFN().forward(*args, training=False).y_MK)


@pytest.mark.parametrize(
    "x_dtype, w_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)],
)
def test_non_bf16_inference_is_an_error_naming_the_dtypes_and_the_fix(monkeypatch, x_dtype, w_dtype):
    """A forced twell layer never falls back silently: non-bf16 tensors say what they are and what to do."""
    monkeypatch.setattr(cuda, "unavailable_reason", lambda device=None: None)
    x, *weights = block()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning-and-fallback either
        with pytest.raises(
            ValueError,
            match=rf"got x {str(x_dtype)[6:]} and weights {str(w_dtype)[6:]}.*"
            r"dtype=bfloat16.*kernel=auto",
        ):
            TwellFFN().forward(x.to(x_dtype), *(w.to(w_dtype) for w in weights), training=False)


def test_bf16_autocast_inference_runs_the_kernels_on_bf16_casts(monkeypatch):
    """Validation of fp32 weights under autocast (kernel=twell training) takes the kernels in bf16."""
    monkeypatch.setattr(cuda, "unavailable_reason", lambda device=None: None)
    seen = []
    monkeypatch.setattr(twell_backend, "twell_gated_mlp", lambda *tensors, **_: seen.append([t.dtype for t in tensors]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        TwellFFN().forward(*(t.float() for t in block()), training=False)
    assert seen == [[torch.bfloat16] * 4]


def test_auto_offers_twell_only_bf16_inference_inputs():
    backend, (x, w, _, _) = TwellFFN(), block()
    assert backend.accepts(x, w, training=False)
    assert not backend.accepts(x.float(), w, training=False) and not backend.accepts(x.half(), w, training=False)
    assert not backend.accepts(x, w.float(), training=False)  # fp32 weights without autocast
    assert backend.accepts(x.float(), w.float(), training=True)  # the training op casts under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert backend.accepts(x.float(), w.float(), training=False)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not backend.accepts(x.float(), w, training=False)


def test_transpose_cache_rebuilds_on_update_and_forgets_freed_weights():
    cache = TransposeCache()
    w = bf16(64, 256)
    first = cache.get(w)
    assert cache.get(w) is first and torch.equal(first, w.t())
    w.add_(1)
    assert torch.equal(cache.get(w), w.t()) and cache.get(w) is not first
    del w
    assert len(cache) == 0


def test_synthetic_block_hits_the_target_density():
    x, wg, _, _ = synthetic_block(512, 256, 1024, nnz_mean=40, device="cpu", seed=1)
    nnz = (F.linear(x.float(), wg.float()) > 0).sum(dim=1).float()
    assert 30 < nnz.mean().item() < 50
    x, wg, _, _ = synthetic_block(512, 256, 1024, nnz_mean=40, sigma=0.5, device="cpu", seed=1)
    heavy = (F.linear(x.float(), wg.float()) > 0).sum(dim=1).float()
    assert heavy.max() > 3 * nnz.max()  # heavy tail


def test_dense_row_stats_match_the_plain_definitions():
    h = torch.randn(37, 512).to(torch.bfloat16)
    h[h.float() < 0.3] = 0
    h[5] = 0
    l1, l0, fired = dense_row_stats(h)
    torch.testing.assert_close(l1, h.float().abs().sum(dim=1), rtol=1e-5, atol=1e-5)
    assert l0.dtype == torch.int32 and torch.equal(l0, (h != 0).sum(dim=1, dtype=torch.int32))
    assert torch.equal(fired, (h != 0).any(dim=0)) and l0[5] == 0


def test_sm_count_is_looked_up_once_per_device(monkeypatch):
    calls = []

    def properties(index):
        calls.append(index)
        return types.SimpleNamespace(multi_processor_count=100 + index)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cuda._sm_count.cache_clear()
    try:
        devices = (torch.device("cuda", 0), torch.device("cuda"), torch.device("cuda", 1))  # "cuda" is device 1 here
        counts = [cuda.sm_count(d) for d in devices]
    finally:
        cuda._sm_count.cache_clear()
    assert counts == [100, 101, 101] and calls == [0, 1]
