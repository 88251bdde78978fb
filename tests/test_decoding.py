"""sparse_llm.generation.decoding: static-cache decoding gives transformers' greedy continuations; top-p sampling keeps
the right tokens."""

import torch

from sparse_llm.generation.decoding import END_CHECK_EVERY, decode, next_tokens
from sparse_llm.model.llama import ModelConfig, build_model

TINY = ModelConfig(hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, max_position_embeddings=64)
VOCAB, END, PAD = 97, 1, 0


def left_padded(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts [B, max(lengths)] padded on the left, and their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    ids_BS = torch.full((len(lengths), longest), PAD)
    mask_BS = torch.zeros_like(ids_BS)
    for row, n in enumerate(lengths):
        ids_BS[row, longest - n :] = torch.randint(2, VOCAB, (n,), generator=gen)
        mask_BS[row, longest - n :] = 1
    return ids_BS, mask_BS


def test_greedy_decoding_matches_transformers_generate():
    torch.manual_seed(0)
    model = build_model(TINY, vocab_size=VOCAB).eval()
    ids_BS, mask_BS = left_padded([5, 1, 9], seed=1)
    ours = decode(model, ids_BS, mask_BS, max_new_tokens=12, temperature=0, top_p=1.0, end_id=END, pad_id=PAD)
    theirs = model.generate(
        input_ids=ids_BS,
        attention_mask=mask_BS,
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=END,
        pad_token_id=PAD,
    )
    assert torch.equal(ours.new_ids_BT, theirs[:, ids_BS.shape[1] :])
    assert ours.step_ms > 0  # 12 tokens: 11 model steps, the last 9 timed


def test_no_step_time_without_steps_past_the_setup_ones():
    torch.manual_seed(0)
    model = build_model(TINY, vocab_size=VOCAB).eval()
    ids_BS, mask_BS = left_padded([4], seed=3)
    short = decode(model, ids_BS, mask_BS, max_new_tokens=3, temperature=0, top_p=1.0, end_id=END, pad_id=PAD)
    assert short.new_ids_BT.shape == (1, 3) and short.step_ms is None


def test_a_row_that_ends_is_padded_and_decoding_stops_when_all_have_ended():
    torch.manual_seed(0)
    model = build_model(TINY, vocab_size=VOCAB).eval()
    with torch.no_grad():  # all logits 0: greedy takes token 0, here the end token
        model.model.norm.weight.zero_()
    ids_BS, mask_BS = left_padded([3, 4], seed=2)
    new_BT = decode(model, ids_BS, mask_BS, 40, temperature=0, top_p=1.0, end_id=0, pad_id=5).new_ids_BT
    assert new_BT.shape == (2, END_CHECK_EVERY)  # stopped at the first check after all rows ended
    assert (new_BT[:, 0] == 0).all() and (new_BT[:, 1:] == 5).all()


def test_top_p_keeps_the_smallest_set_of_likely_tokens_that_reaches_p():
    probs_V = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits_BV = probs_V.log().expand(4000, -1)
    torch.manual_seed(0)
    drawn = next_tokens(logits_BV, temperature=1.0, top_p=0.7)  # 0.5 < 0.7: the second token is needed too
    counts = torch.bincount(drawn, minlength=4)
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / counts[:2].sum() - 0.5 / 0.8) < 0.04  # renormalised over the kept pair
    assert torch.equal(next_tokens(logits_BV, temperature=1.0, top_p=0.4), torch.zeros(4000, dtype=torch.long))
    assert torch.equal(next_tokens(logits_BV, temperature=0, top_p=0.4), torch.zeros(4000, dtype=torch.long))
