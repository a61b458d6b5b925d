"""Throughput plots for the benchmarks: tokens/s against a batch or block size (log2 axis)."""

from __future__ import annotations


def throughput_plot(path: str, xs: list[int], series: dict[str, tuple[list[float], str]],
                    xlabel: str, title: str, hline: tuple[float, str] | None = None,
                    ylabel: str = "generated tokens/s (prefill included)") -> None:
    """``series`` maps a label to (tokens/s per x, line style); ``hline`` is (value, label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (ys, style) in series.items():
        ax.plot(xs, ys, marker="o", linestyle=style, label=label)
    if hline:
        ax.axhline(hline[0], color="gray", linestyle="--", label=hline[1])
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}")
