"""sparse_llm/bench/hot_split.py and scripts/bench_hot_split.py: a block split into cold neurons (the sparse op) and
hot ones (the dense path) is the same block, and the script records a row per layer and their sum."""

from pathlib import Path

import pytest
import torch
from helpers.script_modules import load_script

from sparse_llm.bench.concentration import gate_positives
from sparse_llm.bench.hot_split import split_forward, split_weights, total_row
from sparse_llm.bench.records import read_records
from sparse_llm.bench.train_block import backward, sparse_forward

bench_hot_split = load_script("bench_hot_split")


@pytest.mark.parametrize("hot_count", [0, 5, 23])
def test_the_split_block_gives_the_whole_blocks_outputs_and_gradients(hot_count: int) -> None:
    gen = torch.Generator().manual_seed(hot_count)
    m, k, n = 40, 16, 24
    x = torch.randn(m, k, generator=gen, dtype=torch.float32)
    weights = [torch.randn(*shape, generator=gen, dtype=torch.float32) / 4 for shape in ((n, k), (n, k), (k, n))]
    hot_N = torch.zeros(n, dtype=torch.bool)
    hot_N[torch.randperm(n, generator=gen)[:hot_count]] = True
    dy = torch.randn(m, k, generator=gen, dtype=torch.float32)
    coeff = torch.tensor(0.1)

    leaves = [x.clone().requires_grad_(), *(w.clone().requires_grad_() for w in weights)]
    y, l1 = sparse_forward(*leaves)
    dx, dw_gate, dw_up, dw_down = backward(y, l1, leaves, dy, coeff)

    cold, hot = split_weights(tuple(weights), hot_N)
    split_leaves = [x.clone().requires_grad_(), *(w.requires_grad_() for w in (*cold, *hot))]
    y_split, l1_split = split_forward(split_leaves[0], tuple(split_leaves[1:4]), tuple(split_leaves[4:]))
    grads = backward(y_split, l1_split, split_leaves if hot_count else split_leaves[:4], dy, coeff)

    torch.testing.assert_close(y_split, y)
    torch.testing.assert_close(l1_split, l1)
    torch.testing.assert_close(grads[0], dx)
    cold_N, hot_index = (~hot_N).nonzero().squeeze(1), hot_N.nonzero().squeeze(1)
    for i, (full_grad, dim) in enumerate(zip((dw_gate, dw_up, dw_down), (0, 0, 1), strict=True)):
        torch.testing.assert_close(full_grad.index_select(dim, cold_N), grads[1 + i])
        if hot_count:
            torch.testing.assert_close(full_grad.index_select(dim, hot_index), grads[4 + i])


def test_gate_positives_count_positive_gates() -> None:
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    w_gate = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]])
    assert gate_positives(x, w_gate)[1].tolist() == [2, 0, 2]


def test_the_sum_row_adds_the_layers_and_takes_each_layers_fastest_path() -> None:
    rows = [
        {"layer": 0, "dense_ms": 3.0, "compiled_ms": 2.5, "sparse_ms": 2.0, "h8_split_ms": 1.5, "h8_hot_ms": 0.5},
        {"layer": 1, "dense_ms": 3.0, "compiled_ms": 2.5, "sparse_ms": 1.0, "h8_split_ms": 1.2, "h8_hot_ms": 0.5},
        {"layer": 2, "dense_ms": 3.0, "compiled_ms": 2.0, "sparse_ms": 4.0, "h8_split_ms": 1.8, "h8_hot_ms": 0.5},
    ]
    assert total_row(rows) == {
        "layer": "sum",
        "dense_ms": 9.0,
        "compiled_ms": 7.0,
        "sparse_ms": 7.0,
        "h8_split_ms": 4.5,
        "h8_hot_ms": 1.5,
        "today_ms": 5.0,  # sparse, sparse, compiled dense
        "best_ms": 4.3,  # split, sparse, split
    }


def test_script_records_a_row_per_layer_and_their_sum(tmp_path: Path) -> None:
    argv = ["--size", "tiny", "--density-l0", "6", "--batch", "1", "--seq-len", "32", "--hot", "8", "--layers", "0"]
    assert bench_hot_split.main([*argv, "--reps", "1", "--device", "cpu", "--record-dir", str(tmp_path)]) == 0
    (record,) = read_records(tmp_path).values()
    layer, total = record["results"]
    assert layer["layer"] == 0 and total["layer"] == "sum"
    assert 0 < layer["h8_share"] <= 1 and layer["h8_cold_l0"] < layer["l0"]
    assert total["sparse_ms"] == layer["sparse_ms"] and total["best_ms"] <= total["today_ms"] <= layer["dense_ms"]
    assert record["settings"]["hot"] == [8] and record["settings"]["dtype"] == "float32"


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--hot", "0"], "--hot take counts"), (["--hot", "4096"], "below N"), (["--layers", "9"], "must lie")],
)
def test_bad_sizes_and_layers_are_usage_errors(extra, message, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--size", "tiny", "--batch", "1", "--seq-len", "8", "--device", "cpu", *extra]
    try:
        code = bench_hot_split.main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2 and message in capsys.readouterr().err
