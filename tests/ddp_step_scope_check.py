"""Weight gradients added into `.grad` in place under DDP, on CPU ranks (gloo), for tests/test_step_scope.py:
`torchrun --nproc_per_node 2 tests/ddp_step_scope_check.py`.

Each rank accumulates 3 micro-batches of its own through a DDP-wrapped layer around the training op (its torch
reference path), as the trainer does: the first two under `no_sync`, all inside `step_scope.optimizer_step` with
gradients added in place. The op hands autograd no gradient for the weights it added into; DDP's reducer must still
all-reduce them. Every rank checks its averaged gradients against a single process's sum over all ranks' batches and
prints how many backwards added in place; it exits non-zero on a mismatch.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

from sparse_llm import twell_train
from sparse_llm.step_scope import optimizer_step
from sparse_llm.twell_train import twell_train_ffn

M, K, N, MICRO_BATCHES = 24, 16, 64, 3


class Layer(nn.Module):
    """A dense projection (a parameter autograd accumulates as ever) in front of the training op's three weights."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.proj = nn.Parameter(torch.randn(K, K, generator=gen) / K**0.5)
        self.w_gate, self.w_up = (nn.Parameter(torch.randn(N, K, generator=gen)) for _ in range(2))
        self.w_down = nn.Parameter(torch.randn(K, N, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = twell_train_ffn(x @ self.proj, self.w_gate, self.w_up, self.w_down, width=20)
        return (result.y_MK.square().mean() + 0.01 * result.l1_sum) / MICRO_BATCHES


def tokens(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(M, K, generator=torch.Generator().manual_seed(100 * rank + micro))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    added = []
    reference_backward = twell_train._reference_backward

    def counting(*args, grads_into=None):
        added.append(grads_into is not None)
        return reference_backward(*args, grads_into=grads_into)

    twell_train._reference_backward = counting
    model = nn.parallel.DistributedDataParallel(Layer())
    with optimizer_step(add_into_grads=True):
        for micro in range(MICRO_BATCHES):
            last = micro == MICRO_BATCHES - 1
            with model.no_sync() if not last else torch.enable_grad():
                model(tokens(rank, micro)).backward()
    single = Layer()
    for r in range(world):
        for micro in range(MICRO_BATCHES):
            (single(tokens(r, micro)) / world).backward()
    errors = {
        name: float((p.grad - q.grad).abs().max() / q.grad.abs().max())
        for (name, p), q in zip(model.module.named_parameters(), single.parameters(), strict=True)
    }
    print(f"rank {rank}: added in place {added}; max errors {errors}", flush=True)
    dist.destroy_process_group()
    if sum(added) != MICRO_BATCHES - 1 or max(errors.values()) > 1e-5:
        sys.exit(1)


if __name__ == "__main__":
    main()
