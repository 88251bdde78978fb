"""Batches for training and validation from the token sources of `sparse_llm.data.pipeline`.

Loader position: ``TrainLoader.state_dict()`` is a small JSON-serialisable dict; a new loader given it
through ``load_state_dict`` yields exactly the batches the original would have yielded next. For streamed
sources the position is (epoch, documents read by this rank, tokens of the next document already used);
resuming re-opens the stream and skips the documents already read, which re-reads them from the source
(fast for local files, a network read for fineweb_edu). Streamed positions differ between ranks, so a
trainer must save each rank's state; array positions are the same on every rank.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from sparse_llm.data.pipeline import ENCODE_BATCH, DocumentStream, TokenArray, TokenSource

log = logging.getLogger(__name__)


def val_batches(source: TokenArray, micro_batch: int, seq_len: int, max_batches: int) -> list[torch.Tensor]:
    """The first ``max_batches`` batches of consecutive ``seq_len`` blocks of ``source``, in order.

    Returns a list of ``[micro_batch, seq_len]`` int64 tensors (the last may have fewer rows); the same on
    every call and every rank.
    """
    _check_positive(micro_batch=micro_batch, seq_len=seq_len, max_batches=max_batches)
    n_blocks = len(source) // seq_len
    if n_blocks == 0:
        raise ValueError(f"the validation split has {len(source)} tokens, fewer than seq_len={seq_len}")
    starts = [i * seq_len for i in range(min(n_blocks, micro_batch * max_batches))]
    return [source.blocks(starts[i : i + micro_batch], seq_len) for i in range(0, len(starts), micro_batch)]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


class _ArrayCursor:
    """Shuffled blocks of a ``TokenArray``; each epoch draws a new block offset and permutation."""

    def __init__(
        self,
        source: TokenArray,
        micro_batch: int,
        seq_len: int,
        seed: int,
        rank: int,
        world_size: int,
        step_sequences: int,
    ):
        self.source, self.micro_batch, self.seq_len = source, micro_batch, seq_len
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.step_sequences = step_sequences
        worst_blocks = (len(source) - (seq_len - 1)) // seq_len  # with the largest per-epoch offset
        if worst_blocks < 1:
            raise ValueError(
                f"the training split has {len(source)} tokens, fewer than one sequence of seq_len={seq_len}; "
                "lower seq_len or add data"
            )
        if worst_blocks < step_sequences:
            log.warning(
                "The training split holds %d sequences of %d tokens, fewer than one optimizer step (%d): "
                "every step repeats data.",
                worst_blocks,
                seq_len,
                step_sequences,
            )
        self.epoch, self.batch = 0, 0
        self._order = self._epoch_starts(0)

    def _epoch_starts(self, epoch: int) -> np.ndarray:
        """This rank's block start positions for ``epoch``, truncated to whole optimizer steps."""
        rng = np.random.default_rng([self.seed, epoch])
        offset = int(rng.integers(self.seq_len))  # varies the block boundaries between epochs
        n_blocks = (len(self.source) - offset) // self.seq_len
        # An epoch holds whole optimizer steps, so its length, and hence the data order, does not depend on
        # how a step is split over ranks and micro-batches.
        # A corpus smaller than one step is read several times per epoch, each time in a new order.
        passes = -(-self.step_sequences // n_blocks)
        order = np.concatenate([rng.permutation(n_blocks) for _ in range(passes)])
        usable = len(order) // self.step_sequences * self.step_sequences
        order = order[:usable][self.rank :: self.world_size]
        return offset + order * self.seq_len

    def next_batch(self) -> torch.Tensor:
        if (self.batch + 1) * self.micro_batch > len(self._order):
            self.epoch, self.batch = self.epoch + 1, 0
            self._order = self._epoch_starts(self.epoch)
        starts = self._order[self.batch * self.micro_batch : (self.batch + 1) * self.micro_batch]
        self.batch += 1
        return self.source.blocks(starts.tolist(), self.seq_len)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self._order = self._epoch_starts(self.epoch)


class _StreamCursor:
    """Packs a ``DocumentStream`` into blocks; its position is (epoch, document, offset in document)."""

    def __init__(self, source: DocumentStream, micro_batch: int, seq_len: int, seed: int, rank: int, world_size: int):
        self.source, self.micro_batch, self.seq_len = source, micro_batch, seq_len
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self._open(epoch=0, document=0, offset=0)

    def _open(self, epoch: int, document: int, offset: int) -> None:
        """Start reading at ``document`` of ``epoch``, dropping its first ``offset`` tokens."""
        self._pending: list[list[Any]] = []  # [epoch, document index, tokens, tokens used], oldest first
        self._skip_first = offset
        self._open_epoch(epoch, document)

    def _open_epoch(self, epoch: int, document: int) -> None:
        self._epoch, self._next_document = epoch, document
        self._texts = self.source.open(self.seed, epoch, self.rank, self.world_size, document)

    def _fill(self, need: int) -> None:
        """Read documents until ``need`` unused tokens are buffered, starting new epochs at the end."""
        empty_epochs = 0
        while sum(len(t) - used for _, _, t, used in self._pending) < need:
            texts = [text for _, text in zip(range(ENCODE_BATCH), self._texts, strict=False)]
            if not texts:
                empty_epochs += 1
                if empty_epochs > 1:
                    raise ValueError(f"rank {self.rank}'s share of the training stream is empty")
                self._open_epoch(self._epoch + 1, 0)  # keeps the buffered end of the last epoch
                continue
            empty_epochs = 0
            for tokens in self.source.encode(texts):
                used = min(self._skip_first, len(tokens))
                self._skip_first -= used
                self._pending.append([self._epoch, self._next_document, tokens, used])
                self._next_document += 1

    def next_batch(self) -> torch.Tensor:
        need = self.micro_batch * self.seq_len
        self._fill(need)
        out = np.empty(need, dtype=np.int64)
        filled = 0
        while filled < need:
            chunk = self._pending[0]
            take = min(need - filled, len(chunk[2]) - chunk[3])
            out[filled : filled + take] = chunk[2][chunk[3] : chunk[3] + take]
            chunk[3] += take
            filled += take
            if chunk[3] == len(chunk[2]):
                self._pending.pop(0)
        return torch.from_numpy(out.reshape(self.micro_batch, self.seq_len))

    def state_dict(self) -> dict[str, int]:
        if self._pending:
            epoch, document, _, used = self._pending[0]
            return {"epoch": epoch, "document": document, "offset": used}
        return {"epoch": self._epoch, "document": self._next_document, "offset": self._skip_first}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._open(int(state["epoch"]), int(state["document"]), int(state["offset"]))


class TrainLoader:
    """Endless training batches of ``[micro_batch, seq_len]`` int64 token ids (labels = inputs).

    Deterministic given ``seed``; each rank reads a disjoint share of every epoch (same number of batches
    per rank); a new epoch reshuffles. ``state_dict()`` / ``load_state_dict()`` save and restore the exact
    position (JSON-serialisable; for streamed sources it is per rank, see the module docstring).

    ``step_sequences`` is the number of sequences of one optimizer step over all ranks and accumulation
    steps (default: ``micro_batch * world_size``). For token arrays, step ``s`` then reads the same
    sequences whatever the split over ranks and micro-batches: rank ``r`` takes every ``world_size``-th
    block of the epoch's order, so the ranks' micro-batches of one step cover one contiguous stretch of it.
    """

    def __init__(
        self,
        source: TokenSource,
        micro_batch: int,
        seq_len: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        step_sequences: int | None = None,
    ):
        _check_positive(micro_batch=micro_batch, seq_len=seq_len, world_size=world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        step_sequences = step_sequences or micro_batch * world_size
        if step_sequences % (micro_batch * world_size):
            raise ValueError(
                f"step_sequences={step_sequences} is not a multiple of micro_batch x world_size "
                f"= {micro_batch * world_size}"
            )
        if isinstance(source, TokenArray):
            self._cursor = _ArrayCursor(source, micro_batch, seq_len, seed, rank, world_size, step_sequences)
        else:
            self._cursor = _StreamCursor(source, micro_batch, seq_len, seed, rank, world_size)
        cursor_type = type(self._cursor)
        self._identity = {
            "micro_batch": micro_batch,
            "seq_len": seq_len,
            "seed": seed,
            "rank": rank,
            "world_size": world_size,
            "step_sequences": step_sequences,
            "kind": cursor_type.__name__,
        }
        self.batches_seen = 0

    @property
    def tokens_seen(self) -> int:
        """Tokens this rank has yielded (multiply by world_size for the global count)."""
        return self.batches_seen * self._identity["micro_batch"] * self._identity["seq_len"]

    def next_batch(self) -> torch.Tensor:
        """Returns ``[micro_batch, seq_len]`` int64."""
        batch = self._cursor.next_batch()
        self.batches_seen += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {**self._identity, "batches_seen": self.batches_seen, "position": self._cursor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by a loader with the same source, micro_batch, seq_len, seed and rank."""
        # An array position is the same on every rank, so any rank may load rank 0's state; a stream's is not.
        per_rank = self._identity["kind"] == _StreamCursor.__name__
        mismatched = {
            k: (state.get(k), v) for k, v in self._identity.items() if state.get(k) != v and (k != "rank" or per_rank)
        }
        if mismatched:
            raise ValueError(
                "loader state does not match this loader (saved, current): "
                + ", ".join(f"{k}={s!r} vs {c!r}" for k, (s, c) in mismatched.items())
            )
        self._cursor.load_state_dict(state["position"])
        self.batches_seen = int(state["batches_seen"])
