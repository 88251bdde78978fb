"""sparse_llm/bench/concentration.py and scripts/neuron_concentration.py: how unevenly the FFN neurons fire."""

from pathlib import Path

import pytest
import torch
from helpers.script_modules import load_script

from sparse_llm.bench.concentration import concentration_row, neuron_fire_counts
from sparse_llm.bench.model_setup import load_model, make_sparse
from sparse_llm.bench.records import read_records
from sparse_llm.ffn.mlp import recording_statistics
from sparse_llm.model.llama import sparse_mlps

neuron_concentration = load_script("neuron_concentration")


def test_row_of_known_counts() -> None:
    counts_N = torch.tensor([50, 30, 10, 10, 0, 0, 0, 0, 0, 0])  # 100 non-zeros over 100 tokens
    row = concentration_row(counts_N, tokens=100, top_shares=[0.1, 0.5], dense_rate=0.2)
    assert row == {
        "l0_mean": 1.0,
        "never_fired": 0.6,
        "top_0.1_share": 0.5,
        "top_0.5_share": 1.0,
        "above_rate_neurons": 2,  # 50 and 30 fire for more than 20 of the 100 tokens
        "above_rate_share": 0.8,
    }
    flat = concentration_row(torch.cat([counts_N, counts_N]), tokens=100, top_shares=[0.1], dense_rate=0.2, layers=2)
    assert flat["l0_mean"] == 1.0 and flat["top_0.1_share"] == 0.5 and flat["above_rate_neurons"] == 4


def test_a_layer_that_never_fires_has_zero_shares() -> None:
    row = concentration_row(torch.zeros(8, dtype=torch.int64), tokens=16, top_shares=[0.25], dense_rate=0.1)
    assert row["l0_mean"] == 0.0 and row["never_fired"] == 1.0
    assert row["top_0.25_share"] == 0.0 and row["above_rate_neurons"] == 0 and row["above_rate_share"] == 0.0


def test_fire_counts_agree_with_the_ffn_layers_own_sparsity() -> None:
    """Each layer's counts sum to the non-zeros its FFN reports for the same pass (L0 per token), and the neurons
    counted at least once are the ones it reports as fired."""
    model = load_model(torch.device("cpu"), checkpoint=None, size="tiny", vocab_size=None, seed=0).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    make_sparse(model, 6.0, input_ids)
    with recording_statistics(model):
        counts_LN = neuron_fire_counts(model, input_ids)
    assert counts_LN.shape == (model.config.num_hidden_layers, model.config.intermediate_size)
    for counts_N, mlp in zip(counts_LN, sparse_mlps(model), strict=True):
        result = mlp.last_result
        assert int(counts_N.sum()) == int(result.l0_M.sum()) > 0
        assert torch.equal(counts_N > 0, result.fired_N.bool())


def test_script_prints_and_records_a_row_per_layer_and_one_for_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--size", "tiny", "--density-l0", "6", "--batch", "2", "--seq-len", "32", "--device", "cpu"]
    assert neuron_concentration.main([*argv, "--record-dir", str(tmp_path)]) == 0
    (record,) = read_records(tmp_path).values()
    rows = record["results"]
    assert [row["layer"] for row in rows][-1] == "all" and len(rows) >= 2
    assert rows[-1]["l0_mean"] == pytest.approx(sum(r["l0_mean"] for r in rows[:-1]) / (len(rows) - 1), abs=0.02)
    assert record["settings"]["density_l0"] == 6.0 and record["settings"]["dense_rate"] == 0.02
    assert "| layer | l0_mean |" in capsys.readouterr().out


def test_bad_fractions_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        neuron_concentration.main(["--size", "tiny", "--top", "0", "--device", "cpu"])
    assert exit_info.value.code == 2 and "--top takes fractions" in capsys.readouterr().err
