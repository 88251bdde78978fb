"""One training step as the launch distributes it (FSDP, DDP) against the same step in one process: the loss, and
each parameter's gradient and update, to find where a distributed run departs from a single-device one.

    accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/dist_step_check.py --size 0.5b
    accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/dist_step_check.py --mixed-precision no \
        --tol 1e-4                      # fp32: the step must match to rounding (exit code 1 if not)

Every rank builds the same model from one seed, takes its share of one random batch, and steps the prepared
model (the trainer's accelerator, AdamW, clipping and autocast); each rank also steps an unprepared copy on the
whole batch. Rank 0 prints the parameters whose gradients and updates differ most (relative L2 error).
"""

from __future__ import annotations

import argparse
import copy

import torch
from accelerate import Accelerator

from sparse_llm.bench.model_setup import SIZES, size_config
from sparse_llm.bench.timing import relative_error
from sparse_llm.ffn.kernel_choice import KERNEL_CHOICES
from sparse_llm.model.llama import build_model
from sparse_llm.training.config import TrainConfig
from sparse_llm.training.trainer import make_accelerator, make_optimizer, plain_tensor


def step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ids_BS: torch.Tensor,
    acc: Accelerator,
    distributed: bool,
    max_norm: float,
) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One update of `model` on `ids_BS`; returns the loss and each parameter's full gradient and update."""
    module = acc.unwrap_model(model) if distributed else model
    before = {n: plain_tensor(p.detach()).clone() for n, p in module.named_parameters()}
    autocast = (
        acc.autocast()
        if distributed
        else torch.autocast(acc.device.type, dtype=torch.bfloat16, enabled=acc.mixed_precision == "bf16")
    )
    with autocast:
        loss = model(input_ids=ids_BS, labels=ids_BS, use_cache=False).loss
    if distributed:
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), max_norm)
        loss = acc.reduce(loss.detach(), reduction="mean")
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    # The gradients after clipping: both sides clip to the same norm, so a difference here is one in the gradients.
    grads = {n: plain_tensor(p.grad).clone() for n, p in module.named_parameters()}
    optimizer.step()
    updates = {n: plain_tensor(p.detach()) - before[n] for n, p in module.named_parameters()}
    return loss.item(), grads, updates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="tiny", help="configs/model/<size>.yaml")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top", type=int, default=8, help="parameters listed, the largest errors first")
    parser.add_argument("--kernel", choices=KERNEL_CHOICES, default="torch", help="the FFN path (as train.py's kernel)")
    parser.add_argument("--mixed-precision", default="auto", help="as trainer.mixed_precision: auto, bf16 or no")
    parser.add_argument("--tol", type=float, help="exit 1 where any gradient or update error exceeds this")
    args = parser.parse_args()

    cfg = TrainConfig()
    cfg.trainer.mixed_precision = args.mixed_precision
    acc = make_accelerator(cfg)
    torch.manual_seed(args.seed)
    with torch.device(acc.device):
        model = build_model(size_config(args.size, None), kernel=args.kernel)
    reference = copy.deepcopy(model)
    ids_BS = torch.randint(
        model.config.vocab_size,
        (args.batch * acc.num_processes, args.seq),
        generator=torch.Generator().manual_seed(args.seed + 1),
    ).to(acc.device)
    mine_BS = ids_BS[acc.process_index * args.batch : (acc.process_index + 1) * args.batch]

    prepared, optimizer = acc.prepare(model, make_optimizer(model, cfg, acc.device))
    loss, grads, updates = step(prepared, optimizer, mine_BS, acc, True, cfg.trainer.grad_clip)
    ref_loss, ref_grads, ref_updates = step(
        reference, make_optimizer(reference, cfg, acc.device), ids_BS, acc, False, cfg.trainer.grad_clip
    )
    if not acc.is_main_process:
        return
    rows = sorted(
        ((relative_error(grads[n], ref_grads[n]), relative_error(updates[n], ref_updates[n]), n) for n in ref_grads),
        reverse=True,
    )
    print(
        f"{acc.distributed_type.value} x {acc.num_processes}, mixed precision {acc.mixed_precision}, "
        f"{args.size}, {args.batch} x {args.seq} tokens a rank, kernel {args.kernel}"
    )
    print(f"loss {loss:.6f}, one process {ref_loss:.6f}")
    print("| parameter | gradient rel. error | update rel. error |\n|---|---|---|")
    for grad_err, update_err, name in rows[: args.top]:
        print(f"| {name} | {grad_err:.2e} | {update_err:.2e} |")
    worst = max(max(g, u) for g, u, _ in rows)
    print(f"worst over {len(rows)} parameters: {worst:.2e}")
    if args.tol is not None and worst > args.tol:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
