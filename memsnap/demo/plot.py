"""The demo's PNG: the resumed run's loss curve over the reference's, failures marked."""

from __future__ import annotations


def plot_losses(
    reference: dict[int, float],
    resumed: dict[int, float],
    failures: list[int],
    path: str,
    restored: list[int | None] | None = None,
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    if reference:
        xs = sorted(reference)
        ax.plot(
            xs, [reference[s] for s in xs], lw=4, alpha=0.35, color="tab:blue", label="reference run (never failed)"
        )
    xs = sorted(resumed)
    ax.plot(
        xs,
        [resumed[s] for s in xs],
        lw=1.4,
        color="tab:red",
        marker=".",
        ms=4,
        label="memsnap run (node killed, resumed from peers' RAM)",
    )
    for i, step in enumerate(failures):
        ax.axvline(step + 0.5, color="black", ls="--", lw=1)
        note = f"node killed after step {step}"
        if restored and i < len(restored) and restored[i] is not None:
            note += f"\nresumed from step {restored[i]}"
        ax.annotate(note, (step + 0.5, ax.get_ylim()[1]), xytext=(4, -28), textcoords="offset points", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title("memsnap demo: loss with a node failure vs. a run that never failed")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
