"""Inference adds each layer's attention and FFN outputs into the residual stream's own memory (bf16 on CUDA, where
cuBLAS adds in the GEMM's epilogue), and the sparse kernels write each next layer's input norm beside the rows they
store: logits as close to an fp32 reference as the out-of-place bf16 forward's."""

from __future__ import annotations

import pytest
import torch

from sparse_llm.model.llama import ModelConfig, build_model

pytestmark = pytest.mark.any_cuda  # the dense path too: no sm_90a kernels needed

CONFIG = ModelConfig(
    hidden_size=256, intermediate_size=768, num_layers=3, num_heads=4, vocab_size=512, max_position_embeddings=256
)


@pytest.mark.parametrize("kernel", ["torch", "twell"])
def test_in_place_adds_are_as_close_to_fp32_as_the_out_of_place_forward(kernel):
    torch.manual_seed(0)
    fp32 = build_model(CONFIG, kernel="torch").cuda().eval()
    bf16 = build_model(CONFIG, kernel=kernel).to("cuda", torch.bfloat16).eval()
    bf16.load_state_dict(fp32.state_dict())
    out_of_place = build_model(CONFIG, kernel="torch").to("cuda", torch.bfloat16).eval()
    out_of_place.load_state_dict(fp32.state_dict())
    ids = torch.randint(0, CONFIG.vocab_size, (2, 128), device="cuda")
    storage, norms_run = [], []
    for layer in bf16.model.layers:  # a layer handed the next norm returns (stream, normed rows or None)
        layer.register_forward_hook(
            lambda module, args, out: storage.append(
                args[0].data_ptr() == (out[0] if isinstance(out, tuple) else out).data_ptr()
            )
        )
    norms = [layer.input_layernorm for layer in bf16.model.layers] + [bf16.model.norm]
    for i, norm in enumerate(norms):
        norm.register_forward_hook(lambda module, args, out, i=i: norms_run.append(i))
    with torch.no_grad():
        want = fp32(ids, use_cache=False).logits
        got = bf16(ids, use_cache=False).logits.float()
    # the twell kernels write the FFN's output to a new tensor; the dense path adds it into the stream too
    assert storage == [kernel == "torch"] * CONFIG.num_layers
    # the twell kernels write each next norm beside the rows they store: only the first layer's input norm runs
    assert norms_run == ([0] if kernel == "twell" else list(range(len(norms))))
    with torch.enable_grad():  # autograd on: every add out of place
        baseline = out_of_place(ids, use_cache=False).logits.float()
    error, baseline_error = ((t - want).norm() / want.norm() for t in (got, baseline))
    assert error <= 2 * baseline_error + 1e-4, (error, baseline_error)
