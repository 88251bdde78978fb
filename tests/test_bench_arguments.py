"""The benchmark scripts' shared usage checks (sparse_llm/bench/arguments.py): a bad --tokens is a usage error
(exit code 2, one line naming the file and the fix) before any model is built."""

from pathlib import Path

import pytest
from helpers.script_modules import load_script

TOKEN_SCRIPTS = ["bench_hot_split", "bench_model", "bench_train_grid", "neuron_concentration", "profile_train_step"]


@pytest.mark.parametrize("script", TOKEN_SCRIPTS)
def test_a_missing_token_file_is_a_usage_error(script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    missing = tmp_path / "nope"
    with pytest.raises(SystemExit) as exit_info:
        load_script(script).parse_args(["--size", "tiny", "--tokens", str(missing), "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"--tokens {missing}: no token file there" in err and "scripts/tokenize_corpus.py" in err


def test_a_damaged_token_file_says_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "toks.bin").write_bytes(b"")
    (tmp_path / "toks.json").write_text("{this is not JSON")
    with pytest.raises(SystemExit) as exit_info:
        load_script("neuron_concentration").parse_args(["--size", "tiny", "--tokens", str(tmp_path / "toks")])
    assert exit_info.value.code == 2 and "toks.json" in capsys.readouterr().err
