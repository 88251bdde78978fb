"""Tokenize a corpus once into a memory-mapped token file for ``data=tokens``.

Writes ``<out>.bin`` (token ids, uint16 when the vocabulary fits, else uint32; training documents then
validation documents, each followed by eos) and ``<out>.json`` (dtype, vocab size, tokenizer, token and
document counts, ``val_start``: the token index where validation begins). Training with ``data=tokens``
then needs neither ``datasets`` nor network, and skips tokenization.

The options are ``DataConfig`` fields (sparse_llm/data/config.py) given as ``key=value``:

    python scripts/tokenize_corpus.py --out data/embedded                       # the shipped corpus
    python scripts/tokenize_corpus.py --out data/mine name=local 'paths=[corpus/*.jsonl]' tokenizer=embedded
    HF_HUB_OFFLINE=0 python scripts/tokenize_corpus.py --out data/fineweb_edu name=fineweb_edu \\
        tokenizer=HuggingFaceTB/SmolLM2-360M max_documents=200000 val_documents=1000

then ``python train.py data=tokens data.paths=[data/fineweb_edu.bin]``.
"""

from __future__ import annotations

import argparse
import logging
import time

from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from sparse_llm.checks.errors import exit_on_input_error
from sparse_llm.cli.overrides import exit_on_unknown_key
from sparse_llm.data.pipeline import DataConfig, write_token_file

SCRIPT = "tokenize_corpus.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output prefix: writes <out>.bin and <out>.json")
    parser.add_argument("overrides", nargs="*", help="DataConfig fields as key=value (e.g. name=local)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the progress lines
    # Misspelt keys, wrongly typed values, missing files and Ctrl-C end with one line (exit code 2; 130 for Ctrl-C).
    exit_on_unknown_key(args.overrides, DataConfig, SCRIPT)
    with exit_on_input_error(SCRIPT, also=(ValidationError,)):
        cfg: DataConfig = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.from_dotlist(args.overrides))
        )
        start = time.perf_counter()
        meta = write_token_file(cfg, args.out)
    print(
        f"{meta['n_tokens']:,} tokens ({meta['dtype']}), {meta['n_train_documents']:,} training and "
        f"{meta['n_val_documents']:,} validation documents, tokenizer {meta['tokenizer']} "
        f"(vocab {meta['vocab_size']}) -> {args.out}.bin/.json in {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
