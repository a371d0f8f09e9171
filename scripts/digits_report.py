"""What ``scripts/train_digits.py`` shows besides its report: a progress bar, and the curves of ``--plot``."""

from __future__ import annotations

from typing import Any

import numpy as np


def progress_bar(total: int) -> Any:
    """A tqdm bar over ``total`` steps, or None when tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="step", desc="training", dynamic_ncols=True)


def plot(result: Any, steps_per_epoch: int, path: str, ranks: int) -> None:
    """Loss per step and test accuracy per epoch, side by side, as a PNG.

    Args:
        result: a ``train_digits.Result`` (``losses`` and ``accuracies``).
        steps_per_epoch: optimizer steps per epoch (the smoothing window is half of it).
        path: the PNG to write.
        ranks: the ranks that shared each batch (in the title).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    steps = np.arange(1, len(result.losses) + 1)
    left.plot(steps, result.losses, color="#1f77b4", lw=0.8, alpha=0.45, label="global batch")
    window = max(1, steps_per_epoch // 2)
    if len(result.losses) >= window:
        smooth = np.convolve(result.losses, np.ones(window) / window, mode="valid")
        left.plot(steps[window - 1 :], smooth, color="#1f77b4", lw=2, label=f"mean of {window} steps")
    left.set_yscale("log")
    left.set_xlabel("step")
    left.set_ylabel("cross-entropy loss")
    left.set_title("training loss")
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    epochs = np.arange(1, len(result.accuracies) + 1)
    right.plot(epochs, result.accuracies, "o-", color="#d62728", lw=2)
    right.axhline(0.95, color="gray", ls="--", lw=1, label="0.95")
    right.set_ylim(min(0.9, min(result.accuracies) - 0.01), 1.0)
    right.set_xlabel("epoch")
    right.set_ylabel("accuracy")
    right.set_title("test accuracy")
    right.grid(True, alpha=0.3)
    right.legend(loc="lower right")
    fig.suptitle(f"digits, 64-128-10 MLP, {ranks} MPI ranks sharing each batch")
    fig.savefig(path, dpi=110)
    plt.close(fig)
