"""Charts for the command line (`--plot FILE.png`, or .pdf / .svg); matplotlib is an optional extra
(`pip install 'reorder[plot]'`) and is imported only when a plot is asked for."""

from __future__ import annotations


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'reorder[plot]' (or pip install matplotlib)") \
            from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_rank_loads(path: str, loads: dict, title: str, ylabel: str = "cost") -> None:
    """Grouped bars of per-rank load before / after, one panel per module.

    loads: module -> {"dp": d, "before": [d floats], "after": [d floats], "note": panel title}."""
    plt = _pyplot()
    import numpy as np

    names = list(loads)
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 + 1.1 * sum(loads[m]["dp"] for m in names), 3.8),
                             squeeze=False, gridspec_kw={"width_ratios": [max(2, loads[m]["dp"]) for m in names]})
    for ax, m in zip(axes[0], names):
        d = loads[m]["dp"]
        x = np.arange(d)
        before, after = np.asarray(loads[m]["before"]), np.asarray(loads[m]["after"])
        ax.bar(x - 0.2, before, 0.4, label="before (natural)", color="#c8553d")
        ax.bar(x + 0.2, after, 0.4, label="after (reordered)", color="#2a9d8f")
        mean = before.mean()
        ax.axhline(mean, color="grey", lw=0.8, ls="--", label="mean")
        ax.set_xticks(x, [str(r) for r in range(d)])
        ax.set_xlabel(f"{m} DP rank (dp {d})")
        ax.set_title(loads[m].get("note", m), fontsize=9)
        ax.set_ylim(0, max(before.max(), after.max(), 1) * 1.25)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7, loc="upper right", ncol=3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_simulation(path: str, result: dict, title: str) -> None:
    """Per module: straggler time saved per balancer (bars) and the per-micro-batch spread
    distribution before / after (empirical CDF)."""
    plt = _pyplot()
    import numpy as np

    modules = result["modules"]
    balancers = list(result["balancers"])
    fig, axes = plt.subplots(2, len(modules), figsize=(4.2 * len(modules) + 0.6, 6.4), squeeze=False)
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {b: cycle[i % len(cycle)] for i, b in enumerate(balancers)}
    color["before"] = "#c8553d"
    for c, m in enumerate(modules):
        ax = axes[0][c]
        saved = [100 * result["balancers"][b][m]["saved"] for b in balancers]
        bound = 100 * result["bound"][m]["saved"]
        ax.bar(balancers, saved, color=[color[b] for b in balancers])
        ax.axhline(bound, color="grey", ls="--", lw=0.8, label=f"most any equal-count plan can save: {bound:.1f}%")
        for i, s in enumerate(saved):
            ax.annotate(f"{s:.1f}%", (i, s), ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, max(bound, *saved, 1) * 1.3)
        ax.set_title(f"{m} (dp {modules[m]}): straggler time saved", fontsize=9)
        ax.set_ylabel("% of sum of per-micro-batch max")
        ax.legend(fontsize=7, loc="upper left")
        ax = axes[1][c]
        curves = [("before", result["spreads"][m]["before"])] + \
                 [(b, result["spreads"][m][b]) for b in balancers if b != "identity"]
        for label, sp in curves:
            sp = np.sort(np.asarray(sp))
            ax.step(sp, np.arange(1, len(sp) + 1) / max(1, len(sp)), where="post", label=label, color=color[label])
        ax.set_xlabel("per-micro-batch spread (max / mean rank cost)")
        ax.set_ylabel("fraction of micro-batches")
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
