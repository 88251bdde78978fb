"""Self-check of the GPU stack: `python -m sparse_llm.doctor`.

Prints the GPU, compute capability, driver / CUDA / torch / CuPy versions, where the kernel sources
were found, whether each kernel (inference and training) compiles, whether the inference kernels pass
a quick numerical check against the torch reference, and which backend `kernel=auto` would pick for a
typical layer. Exit code 0 when every check that applies to this machine passed (on a machine without
a Hopper GPU the kernel checks are reported as skipped, not failed).
"""

from __future__ import annotations

import sys
import traceback

import torch
import torch.nn.functional as F

from sparse_llm.cuda import runtime
from sparse_llm.ffn import kernel_set
from sparse_llm.ffn.dispatch import SWITCH_MARGIN
from sparse_llm.ffn.torch_backend import TorchFFN
from sparse_llm.ffn.twell.backend import TwellFFN
from sparse_llm.ffn.twell.infer_launch import direct_up_down
from sparse_llm.ffn.twell.infer_op import twell_gated_mlp
from sparse_llm.ffn.twell.synthetic import synthetic_block
from sparse_llm.formats import gated_mlp_ref

CHECK_K = 2048  # hidden size of the typical layer the doctor checks (the 2B model's)
CHECK_N = 5632  # and its FFN width
WIDE_N = 11264  # an FFN too wide for 16-column slices of the slices walk (inference takes 8)
KERNELS = tuple(
    dict.fromkeys(  # (source file, kernel name): every kernel a model of that width may run
        kernel_set.inference_kernels(CHECK_K, CHECK_N)
        + kernel_set.inference_kernels(CHECK_K, WIDE_N)
        + kernel_set.training_kernels(CHECK_K, CHECK_N)
        + list(kernel_set.ROPE_KERNELS)
    )
)


def _versions() -> list[tuple[str, str]]:
    rows = [
        ("python", sys.version.split()[0]),
        ("torch", torch.__version__),
        ("torch CUDA", str(torch.version.cuda)),
    ]
    cupy = runtime._import_cupy()
    rows.append(("cupy", getattr(cupy, "__version__", "not installed")))
    if cupy is not None:
        try:
            rows.append(("CUDA driver", str(cupy.cuda.runtime.driverGetVersion())))
            rows.append(("NVRTC", ".".join(map(str, cupy.cuda.nvrtc.getVersion()))))
        except Exception as error:
            rows.append(("CUDA driver", f"unavailable ({type(error).__name__})"))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows.append(("GPU", f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"))
        rows.append(("compute capability", "{}.{}".format(*torch.cuda.get_device_capability(0))))
    else:
        rows.append(("GPU", "none visible to torch"))
    return rows


def _sources() -> list[tuple[str, str]]:
    rows = []
    for filename in dict.fromkeys(filename for filename, _ in KERNELS):
        try:
            rows.append((filename, str(runtime.kernel_path(filename))))
        except FileNotFoundError as error:
            rows.append((filename, f"MISSING: {error}"))
    return rows


def _numerical_check(route: str) -> str:
    """route: "direct" (twell_gated_mlp's route past the decode kernel's token counts), or "slices" (the direct
    route's slices walk, which the block op takes only for many tokens)."""
    x, wg, wu, wd = synthetic_block(300, CHECK_K, CHECK_N, nnz_mean=56, sigma=0.5, seed=1)
    if route == "slices":
        y, path = direct_up_down(x, F.linear(x, wg), wu, wd.t().contiguous(), walk="slices")[0], "twell-slices"
    else:
        result = twell_gated_mlp(x, wg, wu, wd, gate_route=route)
        y, path = result.y_MK, result.path
    ref = gated_mlp_ref(x, wg, wu, wd, upcast=True)[0]
    dense = gated_mlp_ref(x, wg, wu, wd)[0].float()
    err = ((y.float() - ref).norm() / ref.norm()).item()
    dense_err = ((dense - ref).norm() / ref.norm()).item()
    verdict = "ok" if err <= 2 * dense_err + 1e-3 else "WRONG"
    return f"{verdict}: rel. error {err:.1e} (dense bf16 {dense_err:.1e}), path {path}"


def main() -> int:
    failures = 0
    print("sparse-llm doctor")
    for key, value in _versions() + _sources():
        print(f"  {key:<22} {value}")
    reason = runtime.unavailable_reason()
    if reason is not None:
        print(f"  twell kernels          skipped: {reason}")
        print("  kernel=auto picks      torch (no usable sparse kernel here)")
        return 0
    print(f"  compiling {len(KERNELS)} kernels (cached after the first run)", flush=True)
    reported: set[tuple[str, str]] = set()

    def report(filename: str, name: str, error: Exception | None) -> None:
        reported.add((filename, name))
        print(f"  compile {name:<22} " + ("ok" if error is None else f"FAILED: {error}"), flush=True)

    failed = runtime.precompile(KERNELS, done=report)
    failures += len(failed)
    for filename, name in KERNELS:
        if (filename, name) in failed:
            continue
        try:
            runtime.get_function(filename, name)  # from the cache the children filled, or compiled here
            if (filename, name) not in reported:
                print(f"  compile {name:<22} ok")
        except Exception as error:
            failures += 1
            print(f"  compile {name:<22} FAILED: {error}")
    for route in ("direct", "slices"):
        try:
            line = _numerical_check(route)
        except Exception:
            line = "FAILED:\n" + traceback.format_exc()
        failures += not line.startswith("ok")
        label = "walk=slices" if route == "slices" else f"gate={route}"
        print(f"  check {label:<16} {line}")

    m, k, n = 16384, CHECK_K, CHECK_N
    for l0 in (28, 112, 560):
        sparse = TwellFFN().estimated_ms(m, k, n, l0, 2 * l0, False)
        dense = TorchFFN().estimated_ms(m, k, n, l0, 2 * l0, False)
        pick = "twell" if sparse is not None and sparse < SWITCH_MARGIN * dense else "torch"
        print(
            f"  kernel=auto, M={m} K={k} N={n}, {l0} non-zeros/token: {pick} "
            f"(predicted twell {sparse:.2f} ms, dense {dense:.2f} ms)"
        )
    print("all checks passed" if failures == 0 else f"{failures} check(s) FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
