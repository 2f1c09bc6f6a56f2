"""Pictures of a run: loss and throughput curves from a run directory's metrics.jsonl."""
from __future__ import annotations

from pathlib import Path

from trainer.errors import StrataError
from trainer.metrics import read_metrics


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write a PNG with train/eval loss and tokens/s against step; returns its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    if not train and not evals:
        raise StrataError(f"strata plot: no metrics in {Path(run_dir) / 'metrics.jsonl'}; pass a run directory "
                          "written by `strata train` (e.g. runs/tiny)")
    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend()
    ax_tput.plot([r["step"] for r in train], [r.get("tokens_per_s", 0) for r in train])
    ax_tput.set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
