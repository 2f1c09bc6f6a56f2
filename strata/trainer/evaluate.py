"""Evaluation on held-out data: the mean loss over the evaluation windows of a validation split
(`train.eval_batches`: its first eval_batches × global_batch_size sequences, the same at every world
size, or with 0 every sequence once), each sequence weighing the same, summed over the
data-parallel ranks whatever the layout; the line the console shows for it; and the bytes a split's
tokens spell, for the bits per byte of `strata eval` (`jobs.evaluate_checkpoint`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.data.loader import eval_batches, eval_windows
from strata.data.mixture import Mixture
from strata.data.tokenize import ByteTokenizer, load_file_tokenizer
from strata.data.tokens import TokenDataset, prepared_tokenizer
from strata.parallel import comm, watchdog
from strata.parallel.topology import Topology
from strata.trainer.parallelize import ParallelModel


@dataclass(frozen=True)
class Evaluation:
    """One evaluation's mean loss, over how many sequences, and whether they were the whole split."""

    loss: float
    sequences: int
    whole: bool

    @property
    def perplexity(self) -> float | None:
        """exp(loss); None where that overflows what is worth printing (loss >= 50)."""
        return math.exp(self.loss) if self.loss < 50 else None

    def line(self, step: int) -> str:
        """The console line for this evaluation after step `step`: loss, perplexity, what it
        read."""
        perplexity = f"{self.perplexity:.2f}" if self.perplexity is not None else "overflow"
        read = (
            f"all {self.sequences} sequences of the validation split"
            if self.whole
            else f"the validation split's first {self.sequences} sequences (train.eval_batches × "
            "global_batch_size; 0 reads all of it)"
        )
        return f"step {step}: eval loss {self.loss:.4f} (perplexity {perplexity}) on {read}"


@torch.no_grad()
def evaluate(
    model: ParallelModel,
    dataset: TokenDataset | Mixture,
    batches: int,
    global_batch: int,
    micro_batch: int,
    topo: Topology,
) -> Evaluation:
    """`model`'s loss on `dataset`'s first `batches` global batches of windows, or all of them with
    0 (`eval_windows`), in eval mode (collective over the data-parallel group). A shorter last
    micro-batch counts for its sequences; a replica the windows' end leaves with fewer micro-batches
    than the others runs padding ones that count nothing (`_padding`), so every rank makes the same
    collectives (an expert-parallel all-to-all or a ZeRO-3 gather spans the replicas). Each
    micro-batch done is progress for the hang watchdog."""
    model.train(False)
    windows = eval_windows(len(dataset), batches, global_batch)
    sums = torch.zeros(2, dtype=torch.float64, device=model.device)  # loss × sequences, sequences
    ran = 0
    for inputs, targets in eval_batches(
        dataset, windows, micro_batch, topo.data_rank, topo.data_size
    ):
        sums[0] += model.eval_loss(inputs, targets).double() * len(inputs)
        sums[1] += len(inputs)
        ran += 1
        watchdog.batch_done()
    for inputs, targets in _padding(dataset, windows, micro_batch, topo.data_size, ran):
        model.eval_loss(inputs, targets)
        watchdog.batch_done()
    model.train(True)
    total, sequences = comm.all_reduce(sums, topo.group("dp"), dim="dp").tolist()
    # the dp group holds each replica's cp ranks, which read the same sequences
    return Evaluation(total / sequences, round(sequences / topo.layout.cp), windows == len(dataset))


def _padding(
    dataset: TokenDataset | Mixture, windows: int, micro_batch: int, dp_size: int, ran: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches a replica that ran `ran` of the first `windows` windows' runs besides, to
    make as many as the replica with the most: the split's first windows, whose loss is not
    counted."""
    most = -(-windows // (dp_size * micro_batch))  # rank 0's: it never runs short
    for _ in range(most - ran):
        yield dataset.batch(list(range(min(micro_batch, windows))))


# --- bits per byte ---------------------------------------------------------------------------------


def target_bytes(data_dir: Path, dataset: TokenDataset) -> int:
    """The UTF-8 bytes the whole split's scored tokens (every window's targets) spell, for bits per
    byte: each end-of-document token spells none; a tokenizer.json's tokens are decoded window by
    window; byte-level tokens are one byte each."""
    file, eot = prepared_tokenizer(data_dir, "--data")
    windows = (dataset.window(i)[1:] for i in range(len(dataset)))
    if file is None:
        return sum(int((w < ByteTokenizer.eot).sum()) for w in windows)
    tok = load_file_tokenizer(file)
    return sum(len(tok.decode([int(t) for t in w if t != eot]).encode("utf-8")) for w in windows)
