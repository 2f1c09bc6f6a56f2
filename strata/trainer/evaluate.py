"""Evaluation on held-out data: the mean loss over the evaluation windows of a validation split
(`train.eval_batches`: its first eval_batches × global_batch_size sequences, the same at every world
size, or with 0 every sequence once), each sequence weighing the same (with loss masks, each trained
target), summed over the data-parallel ranks whatever the layout; the line the console shows for
it; and the bytes a split's scored tokens spell, for the bits per byte of `strata eval`
(`jobs.evaluate_checkpoint`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from strata.data.loader import eval_batches, eval_windows
from strata.data.mixture import Mixture
from strata.data.tokenize import ByteTokenizer, load_file_tokenizer
from strata.data.tokens import Batch, TokenDataset, prepared_tokenizer
from strata.errors import DataError
from strata.parallel import comm, watchdog
from strata.parallel.topology import Topology
from strata.trainer.parallelize import ParallelModel


@dataclass(frozen=True)
class Evaluation:
    """One evaluation's mean loss, over how many sequences and scored targets (with loss masks the
    trained ones, else every one; with `pairs`, DPO's mean pair loss over that many preference
    pairs), and whether they were the whole split."""

    loss: float
    sequences: int
    whole: bool
    targets: int
    pairs: bool = False

    @property
    def perplexity(self) -> float | None:
        """exp(loss); None where that overflows what is worth printing (loss >= 50) or for pairs."""
        return math.exp(self.loss) if self.loss < 50 and not self.pairs else None

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
        if self.pairs:
            return f"step {step}: eval DPO loss {self.loss:.4f} over {self.targets} pairs of {read}"
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
    micro-batch counts for its sequences (with loss masks, its trained targets); a replica the
    windows' end leaves with fewer micro-batches than the others runs padding ones that count
    nothing (`_padding`), so every rank makes the same collectives (an expert-parallel all-to-all
    or a ZeRO-3 gather spans the replicas). Each micro-batch done is progress for the hang
    watchdog."""
    model.train(False)
    windows = eval_windows(len(dataset), batches, global_batch)
    # the loss times its weight (the sequences, or the trained targets), and the weight
    sums = torch.zeros(2, dtype=torch.float64, device=model.device)
    ran = 0
    for batch in eval_batches(dataset, windows, micro_batch, topo.data_rank, topo.data_size):
        loss, weight = model.eval_loss(batch)
        sums[0] += loss
        sums[1] += weight
        ran += 1
        watchdog.batch_done()
    for batch in _padding(dataset, windows, micro_batch, topo.data_size, ran):
        model.eval_loss(batch)
        watchdog.batch_done()
    model.train(True)
    total, weight = comm.all_reduce(sums, topo.group("dp"), dim="dp").tolist()
    if weight == 0:
        raise DataError(
            f"the validation split's first {windows} sequences have no trained target (their loss "
            "mask is 0 everywhere), so their loss divides by zero; `strata data prepare` drops "
            "conversations without a trained token, so this data's val.mask.bin was written "
            "otherwise: prepare it again"
        )
    # the dp group holds each replica's cp ranks, which read the same sequences; every window is
    # one replica's
    targets = round(weight) if dataset.has_mask else windows * dataset.seq_len
    pairs = model.objective is not None  # DPO: the weights are preference pairs
    return Evaluation(total / weight, windows, windows == len(dataset), targets, pairs)


def _padding(
    dataset: TokenDataset | Mixture, windows: int, micro_batch: int, dp_size: int, ran: int
) -> Iterator[Batch]:
    """The micro-batches a replica that ran `ran` of the first `windows` windows' runs besides, to
    make as many as the replica with the most: the split's first windows, whose loss is not
    counted."""
    most = -(-windows // (dp_size * micro_batch))  # rank 0's: it never runs short
    for _ in range(most - ran):
        yield dataset.batch(list(range(min(micro_batch, windows))))


# --- bits per byte ---------------------------------------------------------------------------------


def target_bytes(data_dir: Path, dataset: TokenDataset) -> int:
    """The UTF-8 bytes the whole split's scored tokens (every window's targets; with a loss mask,
    the trained ones) spell, for bits per byte: each end-of-document token spells none; a
    tokenizer.json's tokens are decoded run by run of consecutive scored targets; byte-level tokens
    are one byte each."""
    file, eot = prepared_tokenizer(data_dir, "--data")
    runs = (run for i in range(len(dataset)) for run in _scored_runs(dataset, i))
    if file is None:
        return sum(int((run < ByteTokenizer.eot).sum()) for run in runs)
    tok = load_file_tokenizer(file)
    return sum(len(tok.decode([int(t) for t in run if t != eot]).encode("utf-8")) for run in runs)


def _scored_runs(dataset: TokenDataset, i: int) -> list[np.ndarray]:
    """Window `i`'s scored targets as runs of consecutive tokens: all of them, or with a loss
    mask each stretch it trains."""
    targets = dataset.window(i)[1:]
    if not dataset.has_mask:
        return [targets]
    trained = dataset.loss_mask(i)[1:]
    edges = np.flatnonzero(np.diff(np.concatenate(([0], trained.astype(np.int8), [0]))))
    return [targets[a:b] for a, b in zip(edges[::2], edges[1::2])]
