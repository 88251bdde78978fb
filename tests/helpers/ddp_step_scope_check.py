"""Weight gradients added into `.grad` in place under DDP, for tests/test_step_scope.py (CPU ranks, the op's torch
reference) and tests/gpu/test_step_scope_gpu.py (ranks on CUDA, the op's kernels):
`torchrun --nproc_per_node 2 tests/helpers/ddp_step_scope_check.py [cpu|cuda]`.

Each rank accumulates 3 micro-batches of its own through a DDP-wrapped layer around the training op, as the trainer
does: the first two under `no_sync`, all inside `step_scope.optimizer_step` with gradients added in place. The op
hands autograd no gradient for the weights it added into; DDP's reducer must still all-reduce them. Every rank checks
its averaged gradients against a single process's sum over all ranks' batches and prints how many backwards added in
place; it exits non-zero on a mismatch.

On CUDA the ranks share the gloo backend (two ranks may share one GPU, which NCCL refuses), the weights are float32
masters under bf16 autocast, as in training, and the tokens are heavy-tailed, so that the heavy tokens' GEMMs add
into the gradients as well as the kernels.
"""

import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from sparse_llm.ffn.step_scope import optimizer_step
from sparse_llm.ffn.twell import train_op
from sparse_llm.ffn.twell.synthetic import synthetic_block
from sparse_llm.ffn.twell.train_op import twell_train_ffn

MICRO_BATCHES = 3
# (M, K, N, width, tolerance) per device: the CUDA kernels need K % 64 == 0 and N % 256 == 0; their fp32 atomics and
# the single process's different summation order leave ~1e-6 relative differences
SHAPES = {"cpu": (24, 16, 64, 20, 1e-5), "cuda": (512, 256, 1024, 32, 1e-4)}
NNZ_MEAN = 30  # CUDA tokens' mean gate non-zeros: with width 32 about half of them are heavy


class Layer(nn.Module):
    """The training op's three weights, and a dense projection after it (a parameter autograd accumulates as ever)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        m, k, n, _, _ = SHAPES[device]
        if device == "cuda":
            weights = [w.float() for w in synthetic_block(m, k, n, NNZ_MEAN, sigma=0.5, seed=0)[1:]]
        else:
            gen = torch.Generator().manual_seed(0)
            weights = [torch.randn(*shape, generator=gen) for shape in ((n, k), (n, k), (k, n))]
        self.w_gate, self.w_up, self.w_down = map(nn.Parameter, weights)
        noise = torch.randn(k, k, generator=torch.Generator().manual_seed(1)).to(device)
        self.proj = nn.Parameter(torch.eye(k, device=device) + 0.01 * noise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = SHAPES[x.device.type][3]
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if x.is_cuda else nullcontext()
        with autocast:
            result = twell_train_ffn(x, self.w_gate, self.w_up, self.w_down, width=width)
            y = result.y_MK.float() @ self.proj
        return (y.square().mean() + 0.01 * result.l1_sum) / MICRO_BATCHES


def tokens(device: str, rank: int, micro: int) -> torch.Tensor:
    m, k, n, _, _ = SHAPES[device]
    seed = 100 * rank + micro
    if device == "cuda":
        return synthetic_block(m, k, n, NNZ_MEAN, sigma=0.5, seed=seed)[0]
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def main(device: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    added = []
    backward_name = "cuda_backward" if device == "cuda" else "_reference_backward"
    backward = getattr(train_op, backward_name)

    def counting(*args, grads_into=None):
        added.append(grads_into is not None)
        return backward(*args, grads_into=grads_into)

    setattr(train_op, backward_name, counting)
    model = nn.parallel.DistributedDataParallel(Layer(device))
    with optimizer_step(add_into_grads=True):
        for micro in range(MICRO_BATCHES):
            last = micro == MICRO_BATCHES - 1
            with model.no_sync() if not last else nullcontext():
                model(tokens(device, rank, micro)).backward()
    setattr(train_op, backward_name, backward)
    single = Layer(device)
    for r in range(world):
        for micro in range(MICRO_BATCHES):
            (single(tokens(device, r, micro)) / world).backward()
    errors = {
        name: float((p.grad - q.grad).abs().max() / q.grad.abs().max())
        for (name, p), q in zip(model.module.named_parameters(), single.parameters(), strict=True)
    }
    # One write per line: unbuffered, print writes the text and its newline apart, and the two ranks' lines can merge.
    sys.stdout.write(f"rank {rank}: added in place {added}; max errors {errors}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    if sum(added) != MICRO_BATCHES - 1 or max(errors.values()) > SHAPES[device][4]:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
