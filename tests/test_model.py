"""SparseMLP equals the stock LlamaMLP(relu); model sizes; HF round trip; backend switch."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from sparse_llm.ffn import registry
from sparse_llm.ffn.mlp import SparseMLP
from sparse_llm.ffn.registry import get_backend
from sparse_llm.ffn.torch_backend import TorchFFN
from sparse_llm.model.llama import (
    CausalLlamaModel,
    ModelConfig,
    build_model,
    compile_layers,
    count_parameters,
    llama_config,
    load_pretrained,
    sparse_mlps,
)

TINY = ModelConfig(
    hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, vocab_size=97, max_position_embeddings=64
)


def test_sparse_mlp_matches_llama_mlp_relu():
    torch.manual_seed(0)
    stock = LlamaForCausalLM(llama_config(TINY)).eval()
    x = torch.randn(3, 5, TINY.hidden_size)
    reference = stock.model.layers[0].mlp(x)
    stock_logits = stock(torch.arange(20).view(2, 10)).logits
    from sparse_llm.model.llama import sparsify

    sparse = sparsify(stock, kernel="torch")
    assert isinstance(sparse.model.layers[0].mlp, SparseMLP)
    torch.testing.assert_close(sparse.model.layers[0].mlp(x), reference, rtol=0, atol=0)
    torch.testing.assert_close(sparse(torch.arange(20).view(2, 10)).logits, stock_logits, rtol=0, atol=0)


def test_parameter_names_are_the_stock_ones():
    stock = LlamaForCausalLM(llama_config(TINY))
    ours = build_model(TINY)
    assert list(ours.state_dict()) == list(stock.state_dict())


@pytest.mark.parametrize(
    "size,layers,billions", [("0.5b", 8, 0.512), ("1b", 18, 1.026), ("1.5b", 28, 1.539), ("2b", 38, 2.053)]
)
def test_paper_sizes_on_meta_device(size, layers, billions):
    cfg = ModelConfig(
        name=size,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=layers,
        num_heads=32,
        vocab_size=49152,
        max_position_embeddings=2048,
    )
    with torch.device("meta"):
        model = build_model(cfg)
    assert len(sparse_mlps(model)) == layers
    assert count_parameters(model) / 1e9 == pytest.approx(billions, abs=1e-3)


def test_save_and_from_pretrained_give_identical_logits(tmp_path):
    torch.manual_seed(1)
    model = build_model(TINY, kernel="torch").eval()
    ids = torch.randint(0, TINY.vocab_size, (2, 12))
    expected = model(ids).logits
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # stock HF class, no custom code
    assert type(plain) is LlamaForCausalLM and plain.config.hidden_act == "relu"
    torch.testing.assert_close(plain(ids).logits, expected, rtol=0, atol=0)
    ours = load_pretrained(tmp_path, kernel="torch").eval()
    torch.testing.assert_close(ours(ids).logits, expected, rtol=0, atol=0)


def test_load_pretrained_names_a_bad_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path / "nope")


def test_silu_model_is_rejected():
    cfg = llama_config(TINY)
    cfg.hidden_act = "silu"
    from sparse_llm.model.llama import sparsify

    with pytest.raises(ValueError, match="ReLU"):
        sparsify(LlamaForCausalLM(cfg))


def test_unknown_and_unavailable_kernels():
    with pytest.raises(ValueError, match="auto"):
        SparseMLP(8, 256, kernel="fast")
    with pytest.raises(ValueError, match="Unknown FFN backend"):
        get_backend("nope")
    mlp = SparseMLP(64, 256, kernel="twell")
    with pytest.raises((RuntimeError, ValueError), match="twell"):
        mlp(torch.randn(4, 64))  # no CUDA kernels on a CPU: a clear error, never a silent fallback


def test_auto_uses_torch_on_cpu_and_reports_the_path():
    mlp = SparseMLP(64, 256, kernel="auto")
    mlp(torch.randn(4, 64))
    assert mlp.last_result.path == "torch"


def test_inference_calls_skip_statistics_unless_recorded_or_refreshing_the_dispatcher():
    from sparse_llm.ffn.mlp import SELF_OBSERVE_EVERY, recording_statistics

    model = nn.Sequential(SparseMLP(64, 256, kernel="auto"))
    mlp, x = model[0], torch.randn(4, 64)
    with torch.no_grad():
        mlp(x)  # the first call refreshes the layer's backend decision, from its own L0
        assert mlp.last_result.l0_M is not None and mlp.dispatcher.l0_mean is not None
        mlp(x)
        assert mlp.last_result.l0_M is None and mlp.last_result.l1_sum is None and mlp.last_result.fired_N is None
        with recording_statistics(model):
            mlp(x)
            assert mlp.last_result.l0_M.shape == (4,) and mlp.last_result.fired_N.shape == (256,)
        assert mlp.record_statistics is False  # restored
        for _ in range(SELF_OBSERVE_EVERY - 3):
            mlp(x)
        assert mlp.last_result.l0_M is None
        mlp(x)  # call SELF_OBSERVE_EVERY: the next refresh
        assert mlp.last_result.l0_M is not None
    mlp(x)  # training calls always carry them
    assert mlp.last_result.l1_sum.requires_grad and mlp.last_result.l0_M is not None


def test_l1_gradients_survive_gradient_checkpointing():
    """The L1 term is read from each layer's last forward; recomputation in backward must not change grads."""
    from sparse_llm.training.sparsity import l1_term

    def grads(checkpointing: bool) -> list[torch.Tensor]:
        torch.manual_seed(3)
        model = build_model(TINY, kernel="torch").train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(0, TINY.vocab_size, (2, 16))
        out = model(input_ids=ids, labels=ids)
        loss = out.loss + 1e-2 * l1_term([m.last_result for m in sparse_mlps(model)])
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    for plain, checkpointed in zip(grads(False), grads(True), strict=True):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-7)


def logits_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and parameter gradients of one training forward + backward on ids."""
    model.zero_grad()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), [p.grad.clone() for p in model.parameters()]


def test_causal_model_skips_the_mask_builder_and_matches_transformers(monkeypatch):
    """Without padding or cache the model builds no mask (transformers' builder reads a device value back); logits and
    gradients equal transformers' forward, and calls with a padding mask still go through it."""
    import transformers.masking_utils as masking
    from transformers.models.llama.modeling_llama import LlamaModel

    checks = []
    packed_check = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda ids: checks.append(1) or packed_check(ids))
    torch.manual_seed(2)
    model = build_model(TINY, kernel="torch").train()
    ids = torch.randint(0, TINY.vocab_size, (2, 16))

    logits, grads = logits_and_grads(model, ids)
    assert checks == []
    model.model.__class__ = LlamaModel
    want_logits, want_grads = logits_and_grads(model, ids)
    assert checks == [1]  # transformers' forward runs the check
    model.model.__class__ = CausalLlamaModel
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    padded = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    torch.testing.assert_close(padded, logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_decoder_layer_matches_transformers_and_keeps_mlp_hooks(autocast):
    """The FFN residual add moved into the SparseMLP call, and under autocast the FFN input's cast moved before it,
    change nothing: same logits and gradients as transformers' decoder layer, and forward hooks on the MLP still see
    every call."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from sparse_llm.model.llama import FusedDecoderLayer

    torch.manual_seed(4)
    model = build_model(TINY, kernel="torch").train()
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    seen = []
    for layer in model.model.layers:
        assert type(layer) is FusedDecoderLayer
        layer.mlp.register_forward_hook(lambda module, args, out: seen.append(out.shape))

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits, grads = logits_and_grads(model, ids)
        assert len(seen) == TINY.num_layers
        for layer in model.model.layers:
            layer.__class__ = LlamaDecoderLayer
        want_logits, want_grads = logits_and_grads(model, ids)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)
    for got, want in zip(grads, want_grads, strict=True):
        if autocast:  # one cast of the FFN input: its two GEMMs' input gradients are summed in bf16, not float32
            assert (got - want).norm() <= 1e-2 * want.norm()
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_layers_give_the_eager_loss_and_gradients(checkpointing):
    """compile_layers traces each decoder layer around its SparseMLP (run eagerly): same loss, L1 term, gradients
    and state-dict keys. aot_eager traces as inductor does without generating kernels (seconds on a CPU)."""
    from sparse_llm.training.sparsity import l1_term

    def run(compiled: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[str]]:
        torch.manual_seed(5)
        model = build_model(TINY, kernel="torch").train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if compiled:
            compile_layers(model, backend="aot_eager")
        ids = torch.randint(0, TINY.vocab_size, (2, 16))
        out = model(input_ids=ids, labels=ids)
        loss = out.loss + 1e-2 * l1_term([m.last_result for m in sparse_mlps(model)])
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()], list(model.state_dict())

    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    loss, grads, keys = run(compiled=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before  # the layers were traced
    eager_loss, eager_grads, eager_keys = run(compiled=False)
    assert keys == eager_keys
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_matches_stock_forward_and_backward(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from sparse_llm.model.llama import FusedRMSNorm

    torch.manual_seed(0)
    stock = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    fused = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    fused.load_state_dict(stock.state_dict())
    fused.__class__ = FusedRMSNorm
    x = (torch.randn(4, 7, 48) * 3).to(dtype)
    x_stock, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_stock, y_fused = stock(x_stock), fused(x_fused)
    dy = torch.randn_like(y_stock)
    (y_stock * dy).sum().backward()
    (y_fused * dy).sum().backward()
    # bf16: the fused op scales by the weight before its one rounding, the stock module after a rounding
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-2)
    assert y_fused.dtype == dtype
    torch.testing.assert_close(y_fused, y_stock, **tol)
    torch.testing.assert_close(x_fused.grad, x_stock.grad, **tol)
    torch.testing.assert_close(
        fused.weight.grad,
        stock.weight.grad,
        rtol=2**-7 if dtype != torch.float32 else 1e-5,
        atol=5e-2 if dtype != torch.float32 else 1e-5,
    )


def test_fused_rms_norm_keeps_the_stock_cast_order_on_mixed_dtypes():
    """A bf16 input with an fp32 weight (no autocast) goes through the stock forward: same dtype, same values."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from sparse_llm.model.llama import FusedRMSNorm

    stock = LlamaRMSNorm(32)
    fused = LlamaRMSNorm(32)
    fused.__class__ = FusedRMSNorm
    x = torch.randn(5, 32).to(torch.bfloat16)
    torch.testing.assert_close(fused(x), stock(x), rtol=0, atol=0)


def test_sparsify_swaps_norms_and_attention_and_keeps_the_state_dict():
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm

    from sparse_llm.model.llama import FusedRMSNorm, FusedRopeAttention, sparsify

    stock = LlamaForCausalLM(llama_config(TINY))
    keys = list(stock.state_dict())
    model = sparsify(stock, kernel="torch")
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    attentions = [m for m in model.modules() if isinstance(m, LlamaAttention)]
    assert len(norms) == 2 * TINY.num_layers + 1 and len(attentions) == TINY.num_layers
    assert all(type(m) is FusedRMSNorm for m in norms)
    assert all(type(m) is FusedRopeAttention for m in attentions)
    assert list(model.state_dict()) == keys


def test_rope_kernel_is_not_used_off_the_gpu():
    from sparse_llm.model.rope import kernel_applies

    assert not kernel_applies(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 8))


def test_fused_attention_matches_stock_with_padding_and_a_kv_cache():
    """FusedRopeAttention mirrors transformers' forward; on the CPU (rotation by transformers) it must agree
    exactly, through a left-padded prefill and a cached decode step."""
    import copy

    from sparse_llm.model.llama import sparsify

    torch.manual_seed(0)
    stock = LlamaForCausalLM(llama_config(TINY)).eval()
    ours = sparsify(copy.deepcopy(stock), kernel="torch")
    ids = torch.randint(0, TINY.vocab_size, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on the first sequence
    with torch.no_grad():
        outs = [m(input_ids=ids, attention_mask=mask, use_cache=True) for m in (stock, ours)]
        torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=0, atol=0)
        step = torch.randint(0, TINY.vocab_size, (2, 1))
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        nexts = [
            m(input_ids=step, attention_mask=mask, past_key_values=o.past_key_values, use_cache=True)
            for m, o in zip((stock, ours), outs)
        ]
    torch.testing.assert_close(nexts[1].logits, nexts[0].logits, rtol=0, atol=0)


def test_rope_op_names_mismatched_shapes():
    from sparse_llm.model.rope import rotate_half_qk

    q, k = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    with pytest.raises(ValueError, match=r"must be \[1 or 2, 5, 8\]"):
        rotate_half_qk(q, k, torch.randn(2, 6, 8), torch.randn(2, 6, 8))
    with pytest.raises(ValueError, match="must share dtype"):
        rotate_half_qk(q, k.double(), torch.randn(1, 5, 8), torch.randn(1, 5, 8))


def test_sparse_mlp_adds_the_residual_it_is_given():
    """SparseMLP(x, residual) = residual + SparseMLP(x), gradients included; a residual of another shape is refused."""
    torch.manual_seed(0)
    mlp = SparseMLP(64, 256, kernel="torch")
    x, residual = torch.randn(2, 5, 64), torch.randn(2, 5, 64, requires_grad=True)
    out = mlp(x, residual=residual)
    assert torch.equal(out, residual + mlp(x))
    out.sum().backward()
    assert torch.equal(residual.grad, torch.ones_like(residual))
    with pytest.raises(ValueError, match="residual has shape"):
        mlp(x, residual=residual[:, :3])


def test_add_linear_adds_into_the_accumulator_in_every_dtype_case():
    """add_linear_ returns acc + F.linear(a, w, bias) in acc's own memory (on a GPU by one GEMM where dtypes agree),
    also with a bias or a bf16 product into an fp32 accumulator. On the CPU it has the product-then-add's bits."""
    from sparse_llm.ffn.torch_backend import add_linear_

    torch.manual_seed(7)
    a, w, bias = torch.randn(6, 16), torch.randn(8, 16), torch.randn(8)
    for acc_dtype, ab_dtype, b in [
        (torch.float32, torch.float32, None),
        (torch.float32, torch.float32, bias),
        (torch.float32, torch.bfloat16, None),
        (torch.bfloat16, torch.bfloat16, None),
    ]:
        acc = torch.randn(6, 8, dtype=acc_dtype)
        want = acc + nn.functional.linear(a.to(ab_dtype), w.to(ab_dtype), None if b is None else b.to(ab_dtype))
        got = add_linear_(acc, a.to(ab_dtype), w.to(ab_dtype), None if b is None else b.to(ab_dtype))
        assert got.data_ptr() == acc.data_ptr() and got.dtype == acc_dtype
        tol = 1e-5 if acc_dtype == ab_dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want.to(acc_dtype), rtol=tol, atol=tol)
        if acc_dtype == ab_dtype:  # no cast between the product and the add: the same bits as F.linear and then +
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_inference_adds_into_the_residual_stream_and_spares_the_callers_tensors():
    """Without autograd each layer adds its attention and FFN outputs into the residual stream's memory (its output
    is its input's storage), with the logits of the out-of-place forward; embeddings the caller passes and hidden
    states it asks for are left as they were computed."""
    torch.manual_seed(8)
    model = build_model(TINY, kernel="torch").eval()
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    storage = []
    for layer in model.model.layers:
        layer.register_forward_hook(
            lambda module, args, out: storage.append(  # training layers return (stream, FFN output)
                args[0].data_ptr() == (out[0] if isinstance(out, tuple) else out).data_ptr()
            )
        )
    want = model(ids, use_cache=False).logits  # autograd on: every add out of place
    assert storage == [False] * TINY.num_layers
    storage.clear()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
        assert storage == [True] * TINY.num_layers
        storage.clear()

        embeds = model.model.embed_tokens(ids)
        kept = embeds.clone()
        torch.testing.assert_close(model(inputs_embeds=embeds, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(embeds, kept) and storage == [False] + [True] * (TINY.num_layers - 1)

        hidden = model(ids, use_cache=False, output_hidden_states=True).hidden_states
    with torch.enable_grad():
        want_hidden = model(ids, use_cache=False, output_hidden_states=True).hidden_states
    for got, expected in zip(hidden, want_hidden, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


class NormWritingFFN(TorchFFN):
    """The torch path, plus the next norm's rows written beside its output, as the sparse inference kernels write
    them on a GPU."""

    def forward(self, x_MK, w_gate_NK, w_up_NK, w_down_KN, *, output_norm=None, **call):
        result = super().forward(x_MK, w_gate_NK, w_up_NK, w_down_KN, **call)
        if output_norm is not None:
            weight_K, eps = output_norm
            result.normed_MK = F.rms_norm(result.y_MK, (x_MK.shape[1],), weight_K, eps)
        return result


@pytest.mark.parametrize("writes_norm", [False, True])
def test_inference_takes_each_layers_input_norm_from_the_ffn_before_it(monkeypatch, writes_norm):
    """Without autograd each layer's FFN is handed the next layer's input norm (after the last layer, the model's
    norm). Where its backend writes that norm's rows, the next layer skips its own norm and the model its final one;
    where it writes none, every norm runs. The logits are the same either way, and with gradients on nothing is
    handed."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    registry.register_backend(NormWritingFFN() if writes_norm else TorchFFN())  # under the name "torch"
    torch.manual_seed(9)
    model = build_model(TINY, kernel="torch").eval()
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    norms = [layer.input_layernorm for layer in model.model.layers] + [model.model.norm]
    ran = []
    for i, norm in enumerate(norms):
        norm.register_forward_hook(lambda module, args, out, i=i: ran.append(i))
    want = model(ids, use_cache=False).logits  # autograd on
    assert ran == list(range(len(norms)))
    ran.clear()
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
    assert ran == ([0] if writes_norm else list(range(len(norms))))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a layer's statistics do not hold on to the rows it handed on (37 of them held 2.3 GiB at the 2B shape)
    assert all(mlp.last_result.normed_MK is None for mlp in sparse_mlps(model))


def test_training_forward_leaves_each_ffn_add_to_the_next_layer():
    """With gradients on, every SparseMLP is called without the residual (the next layer, or the model after the last
    one, adds its output); without, with it. Both give the same logits, bit for bit; a layer whose MLP is not a
    SparseMLP refuses to defer."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(6)
    model = build_model(TINY, kernel="torch").train()
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    residual_given = []
    for mlp in sparse_mlps(model):
        mlp.register_forward_pre_hook(
            lambda module, args, kwargs: residual_given.append(kwargs.get("residual") is not None), with_kwargs=True
        )
    training_logits = model(ids, use_cache=False).logits
    assert residual_given == [False] * TINY.num_layers
    residual_given.clear()
    with torch.no_grad():
        inference_logits = model(ids, use_cache=False).logits
    assert residual_given == [True] * TINY.num_layers
    torch.testing.assert_close(training_logits, inference_logits, rtol=0, atol=0)

    layer = model.model.layers[0]
    layer.mlp = LlamaMLP(llama_config(TINY))
    with pytest.raises(ValueError, match="defer_ffn_add=True needs the layer's MLP to be a SparseMLP"):
        layer(
            torch.randn(2, 16, TINY.hidden_size),
            position_embeddings=model.model.rotary_emb(torch.randn(2, 16, TINY.hidden_size), torch.arange(16)[None]),
            defer_ffn_add=True,
        )
    assert model(ids, use_cache=False).logits.shape == training_logits.shape  # a stock MLP in a layer: no deferring


def test_fsdp_wraps_the_fused_decoder_layers_and_names_the_class_on_a_stale_config():
    import yaml
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from sparse_llm.model.llama import FusedDecoderLayer
    from sparse_llm.training.trainer import check_fsdp_wrap

    def plugin(names: list[str] | None) -> FullyShardedDataParallelPlugin:
        return FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap=names
        )

    model = build_model(TINY, kernel="torch")
    config = Path(__file__).resolve().parents[1] / "configs/accelerate/fsdp.yaml"
    shipped = yaml.safe_load(config.read_text())["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"]
    for names in (shipped, None):  # the repo's config, and a config that leaves the class to the model
        check_fsdp_wrap(plugin(names), model)
        wrapped = fsdp2_prepare_auto_wrap_policy(plugin(names), model)
        assert [m for m in model.modules() if wrapped(m)] == list(model.model.layers)
        assert all(type(layer) is FusedDecoderLayer for layer in model.model.layers)
    stale = "wraps LlamaDecoderLayer.*fsdp_transformer_layer_cls_to_wrap: FusedDecoderLayer"
    with pytest.raises(ValueError, match=stale):
        check_fsdp_wrap(plugin(["LlamaDecoderLayer"]), model)
