"""``--plot FILE``: step time and batch size over a run (matplotlib, the optional extra ``plot``)."""

from __future__ import annotations

ROUTE_COLORS = {"graph": "tab:green", "cascade graph": "tab:pink", "cascade": "tab:purple", "flat": "tab:blue",
                "": "tab:orange"}


def write_plot(engine, path: str) -> str:
    """Write the run's step time (ms, coloured by how the decode rows ran; prefill-only steps orange) and batch
    size (live requests, decode rows) per step to ``path`` (the format from its suffix). Returns a line for
    the user: where it went, or why nothing was written (matplotlib missing)."""
    try:
        import matplotlib
    except ImportError:
        return (f"plot    skipped: matplotlib is not installed (pip install 'flashgen[plot]'); {path} not written")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rec = engine.records
    steps = range(1, len(rec) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5))
    top.scatter(steps, [r.seconds * 1e3 for r in rec], s=6, c=[ROUTE_COLORS.get(r.route, "k") for r in rec])
    top.set_ylabel("step time (ms)")
    for route, color in ROUTE_COLORS.items():
        if any(r.route == route for r in rec):
            top.scatter([], [], s=12, c=color, label=route or "prefill only")
    top.legend(loc="upper right", fontsize=8)
    bottom.plot(steps, [r.live_seqs for r in rec], label="live requests")
    bottom.plot(steps, [r.decode_rows for r in rec], label="decode rows", alpha=0.7)
    bottom.set_ylabel("batch")
    bottom.set_xlabel("step")
    bottom.legend(loc="upper right", fontsize=8)
    c = engine.config
    fig.suptitle(f"flashgen demo: {len(engine.finished)} requests, {c.num_pages} pages of {c.page_size}, "
                 f"out_of_pages={c.out_of_pages}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"plot    step time and batch size over {len(rec)} steps written to {path}"
