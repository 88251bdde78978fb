"""The rotary-embedding kernel (sparse_llm.model.rope) and FusedRopeAttention against transformers on the GPU.

Reference: transformers' `apply_rotary_pos_emb` in fp32. Budget, as for the FFN kernels: twice the error
of transformers' own rotation in the tested dtype, plus a small atol. Shapes cover grouped-query attention
(fewer k heads), head widths 64 and 128, angles shared across the batch (transformers' usual [1, S, D])
and per sequence, and the three dtype pairs (bf16/bf16 inference, bf16 q with fp32 angles under autocast,
fp32/fp32). Outputs are poisoned (NaN-filled memory handed back by the allocator) before each call.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding, apply_rotary_pos_emb

from sparse_llm.model.llama import FusedRopeAttention
from sparse_llm.model.rope import kernel_applies, rotate_half_qk

ATOL = 1e-3


def angles(batch: int, seq_len: int, width: int, dtype: torch.dtype, shared: bool) -> tuple[torch.Tensor, ...]:
    """cos, sin [1 or batch, S, D] as LlamaRotaryEmbedding makes them (theta 1e5), at random positions."""
    config = LlamaConfig(hidden_size=width * 4, num_attention_heads=4, rope_theta=1e5, max_position_embeddings=4096)
    rotary = LlamaRotaryEmbedding(config).cuda()
    positions = torch.randint(0, 4096, (1 if shared else batch, seq_len), device="cuda")
    probe = torch.empty(1, device="cuda", dtype=dtype)
    return rotary(probe, positions)


def poison() -> None:
    filler = torch.full((64 << 20,), float("nan"), device="cuda")
    del filler


def reference(q, k, cos, sin):
    q_BHSD, k_BHSD = apply_rotary_pos_emb(
        q.double().transpose(1, 2), k.double().transpose(1, 2), cos.double(), sin.double()
    )
    return q_BHSD.transpose(1, 2), k_BHSD.transpose(1, 2)


def within_budget(got, want, stock):
    err = (got.double() - want).abs().max().item()
    stock_err = (stock.double() - want).abs().max().item()
    assert err <= 2 * stock_err + ATOL * want.abs().max().item() + 1e-6, (err, stock_err)


@pytest.mark.parametrize(
    "q_dtype,angle_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)],
)
@pytest.mark.parametrize("heads,kv_heads,width", [(8, 8, 64), (8, 2, 128), (4, 4, 20)])  # 20: scalar accesses
@pytest.mark.parametrize("shared", [True, False])
def test_rotation_and_its_gradient_match_transformers(q_dtype, angle_dtype, heads, kv_heads, width, shared):
    batch, seq_len = 3, 301
    cos, sin = angles(batch, seq_len, width, angle_dtype, shared)
    q = torch.randn(batch, seq_len, heads, width, device="cuda").to(q_dtype)
    k = torch.randn(batch, seq_len, kv_heads, width, device="cuda").to(q_dtype)
    autocast = angle_dtype != q_dtype
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        assert kernel_applies(q, cos)
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        poison()
        q_rot, k_rot = rotate_half_qk(qg, kg, cos, sin)
        q_stock, k_stock = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    q_ref, k_ref = reference(q, k, cos, sin)
    assert q_rot.dtype == q_dtype and q_rot.shape == q.shape and k_rot.shape == k.shape
    # under autocast transformers' result is fp32, rounded to bf16 by the attention's autocast: compare that
    q_stock, k_stock = (t.transpose(1, 2).to(q_dtype) for t in (q_stock, k_stock))
    within_budget(q_rot, q_ref, q_stock)
    within_budget(k_rot, k_ref, k_stock)

    dq, dk = torch.randn_like(q_rot), torch.randn_like(k_rot)
    poison()
    torch.autograd.backward((q_rot, k_rot), (dq, dk))
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    torch.autograd.backward(reference(q64, k64, cos, sin), (dq.double(), dk.double()))
    # the exact gradient is a rotation of dq: the budget is that of rounding it once to q's dtype
    within_budget(qg.grad, q64.grad, q64.grad.to(q_dtype))
    within_budget(kg.grad, k64.grad, k64.grad.to(q_dtype))


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True)])
def test_fused_attention_matches_stock_attention(dtype, autocast):
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1e5,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    stock = LlamaAttention(config, layer_idx=0).to("cuda", dtype)
    fused = LlamaAttention(config, layer_idx=0).to("cuda", dtype)
    fused.load_state_dict(stock.state_dict())
    fused.__class__ = FusedRopeAttention
    rotary = LlamaRotaryEmbedding(config).cuda()
    x = torch.randn(2, 200, 256, device="cuda", dtype=dtype)
    position_embeddings = rotary(x, torch.arange(200, device="cuda")[None])
    outs, grads = [], []
    for module in (stock, fused):
        xg = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y, _ = module(xg, position_embeddings=position_embeddings, attention_mask=None)  # sdpa's causal path
        y.float().square().sum().backward()
        outs.append(y.float())
        grads.append((xg.grad.float(), module.q_proj.weight.grad.float(), module.k_proj.weight.grad.float()))
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(outs[1], outs[0]) < 1e-2
    for got, want in zip(grads[1], grads[0]):
        assert rel(got, want) < 2e-2


def test_cached_decoding_with_the_kernel_matches_stock():
    """Prefill with left padding, then decode steps from the KV cache: the kernel rotates one position per
    sequence at a time there (angles [B, 1, D])."""
    import copy

    from transformers import LlamaForCausalLM

    from sparse_llm.model.llama import ModelConfig, llama_config, sparsify

    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, vocab_size=101, max_position_embeddings=128
    )
    stock = LlamaForCausalLM(llama_config(cfg)).to("cuda", torch.bfloat16).eval()
    ours = sparsify(copy.deepcopy(stock), kernel="torch")
    ids = torch.randint(0, 101, (3, 17), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    with torch.no_grad():
        outs = [m(input_ids=ids, attention_mask=mask, use_cache=True) for m in (stock, ours)]
        assert rel(outs[1].logits, outs[0].logits) < 2e-2
        caches = [o.past_key_values for o in outs]
        for _ in range(3):
            step = torch.randint(0, 101, (3, 1), device="cuda")
            mask = torch.cat([mask, torch.ones_like(step)], dim=1)
            nexts = [
                m(input_ids=step, attention_mask=mask, past_key_values=c, use_cache=True)
                for m, c in zip((stock, ours), caches)
            ]
            assert rel(nexts[1].logits, nexts[0].logits) < 2e-2
            caches = [n.past_key_values for n in nexts]
