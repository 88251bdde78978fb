"""Token-by-token decoding with a static KV cache; on a GPU each decoding step is replayed as one CUDA graph.

A decoding step feeds one token per row through every layer. For the few rows of generation its kernels are
short (the sparse FFN's decode kernel takes 14-28 us at 1-16 tokens), and issued one by one from Python the
step is host-bound: the GPU waits between launches. Captured once and replayed, the step's kernels run back to
back, the FFN's CuPy launches included (they go to torch's current stream, which is the capture stream).

What a replay cannot do is run Python: each layer's FFN backend is chosen when the step is captured (from the
density the prompt's forward measured) and is kept for the rest of the sequence, and the layers do not observe
their own statistics during the replays.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers import StaticCache

from sparse_llm.ffn.mlp import backends_held, cuda_graphed

log = logging.getLogger(__name__)

# Decoding stops once every row has ended its document; it looks (a host sync) every this many steps.
END_CHECK_EVERY = 8


class DecodeSteps:
    """The model's forward over a left-padded batch of prompts, then one token per row at a time.

    Args:
        model: a causal LM (`LlamaForCausalLM`), in eval mode.
        prompt_mask_BS: [B, S] 1 where a prompt has a token, 0 on its left padding.
        max_new_tokens: tokens the cache keeps room for after the prompts.
        cuda_graph: replay the steps after the first as a CUDA graph (on a GPU; ignored on a CPU).
    """

    def __init__(self, model: nn.Module, prompt_mask_BS: torch.Tensor, max_new_tokens: int, cuda_graph: bool) -> None:
        self.model = model
        device = model.device
        rows, self.prompt_len = prompt_mask_BS.shape
        length = self.prompt_len + max_new_tokens
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        valid_BS = prompt_mask_BS.to(device=device, dtype=torch.bool)
        # Additive masks over the cache's slots: 0 where a query may attend, the dtype's lowest value elsewhere
        # (never -inf: a padding query that sees no key then averages instead of producing NaN).
        self.blocked = torch.finfo(model.dtype).min
        self.keys_B11L = torch.full((rows, 1, 1, length), self.blocked, dtype=model.dtype, device=device)
        self.keys_B11L[:, 0, 0, : self.prompt_len].masked_fill_(valid_BS, 0.0)
        # Positions count each row's own tokens (its padding takes position 0 and is never attended to).
        self.prompt_positions_BS = (valid_BS.long().cumsum(dim=1) - 1).clamp_min(0)
        self.position_B1 = self.prompt_positions_BS[:, -1:].clone()
        self.token_B1 = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.steps = 0
        self.cuda_graph = cuda_graph and device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits_BV: torch.Tensor | None = None  # the captured step's output, rewritten by every replay

    def prefill(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the token after each prompt; fills the cache with the prompts."""
        s = self.prompt_len
        causal_SS = torch.ones(s, s, dtype=torch.bool, device=input_ids_BS.device).tril()
        mask_B1SL = self.keys_B11L.expand(-1, -1, s, -1).clone()
        mask_B1SL[:, :, :, :s].masked_fill_(~causal_SS, self.blocked)
        return self._forward(input_ids_BS, self.prompt_positions_BS, mask_B1SL)

    def __call__(self, token_B: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the next token, after feeding token_B [B] (each row's latest token)."""
        self.keys_B11L[:, :, :, self.prompt_len + self.steps] = 0.0  # the slot this step's key lands in
        self.position_B1.add_(1)
        self.token_B1.copy_(token_B.view(-1, 1))
        self.steps += 1
        if not self.cuda_graph:
            return self._step()
        if self.graph is None and self.steps > 1:  # the first step ran eagerly: kernels loaded, backends chosen
            self.graph = self._capture()
        if self.graph is None:
            return self._warm_up()
        self.graph.replay()
        return self.logits_BV

    def _forward(self, ids_BS: torch.Tensor, positions_BS: torch.Tensor, mask_B1SL: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids_BS,
            position_ids=positions_BS,
            attention_mask=mask_B1SL,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def _step(self) -> torch.Tensor:
        return self._forward(self.token_B1, self.position_B1, self.keys_B11L)

    def _warm_up(self) -> torch.Tensor:
        # On a side stream, as torch asks of work before a capture (lazy initialisations then land off the
        # capture stream's history).
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with cuda_graphed(self.model), torch.cuda.stream(side):
            logits_BV = self._step()
        current.wait_stream(side)
        return logits_BV

    def _capture(self) -> torch.cuda.CUDAGraph | None:
        """The step as a CUDA graph, or None (a warning; the steps then run eagerly) where some op cannot be
        captured. Capturing runs no kernel: the graph's first replay is this step."""
        graph = torch.cuda.CUDAGraph()
        try:
            with backends_held(self.model), cuda_graphed(self.model), torch.cuda.graph(graph):
                self.logits_BV = self._step()
        except RuntimeError as error:
            log.warning("decoding steps run eagerly: a step could not be captured as a CUDA graph (%s)", error)
            self.cuda_graph = False  # nothing captured ran: the caller runs this step eagerly
            return None
        return graph


def next_tokens(logits_BV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Token ids [B] drawn from logits_BV [B, V]: the most likely where temperature is 0, else sampled from the
    softmax at `temperature` among the most likely tokens whose probabilities first reach `top_p`."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    probs_BV = torch.softmax(logits_BV.float() / temperature, dim=-1)
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    # A token stays when the tokens more likely than it hold less than top_p: the most likely always stays.
    before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
    sorted_BV = sorted_BV.masked_fill(before_BV >= top_p, 0.0)
    picked_B1 = torch.multinomial(sorted_BV, num_samples=1)
    return order_BV.gather(-1, picked_B1).squeeze(-1)


@dataclass
class Decoded:
    """What `decode` produced: the new tokens' ids [B, T], and the wall-clock ms per step (its sampling included)
    of the steps after the first `SETUP_STEPS`, None where there were none."""

    new_ids_BT: torch.Tensor
    step_ms: float | None


# The first steps also load kernels and capture the graph: `Decoded.step_ms` leaves them out.
SETUP_STEPS = 2


def _settled_time(device: torch.device) -> float:
    """perf_counter() once the device has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def decode(
    model: nn.Module,
    input_ids_BS: torch.Tensor,
    attention_mask_BS: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    end_id: int,
    pad_id: int,
    cuda_graph: bool = True,
) -> Decoded:
    """Continue each left-padded prompt of input_ids_BS [B, S] (attention_mask_BS 0 on the padding) by up to
    `max_new_tokens` tokens, T <= max_new_tokens of them: a row that ended its document (token `end_id`) is padded
    with `pad_id` after it; decoding stops early once every row has ended."""
    device = model.device
    decoder = DecodeSteps(model, attention_mask_BS, max_new_tokens, cuda_graph)
    logits_BV = decoder.prefill(input_ids_BS.to(device))
    ended_B = torch.zeros(input_ids_BS.shape[0], dtype=torch.bool, device=device)
    new_ids: list[torch.Tensor] = []
    timed_since = None
    for step in range(max_new_tokens):
        if step == SETUP_STEPS:
            timed_since = _settled_time(device)
        token_B = next_tokens(logits_BV, temperature, top_p).masked_fill(ended_B, pad_id)
        new_ids.append(token_B)
        ended_B |= token_B == end_id
        if step == max_new_tokens - 1 or ((step + 1) % END_CHECK_EVERY == 0 and bool(ended_B.all())):
            break
        logits_BV = decoder(token_B)
    timed_steps = len(new_ids) - 1 - SETUP_STEPS  # model steps after the setup ones (the last token needs none)
    step_ms = None
    if timed_since is not None and timed_steps > 0:
        step_ms = (_settled_time(device) - timed_since) * 1e3 / timed_steps
    return Decoded(torch.stack(new_ids, dim=1), step_ms)
