"""What `flashgen bench` writes from a run: the flashgen/peer ratio table (stdout and markdown), the run's JSON
and markdown files, and the ratio plot. A run is a dict:

    {"device", "date", "commit", "copy_GBps", "matmul_TFLOPs", "peers": {"found": {name: version},
     "missing": {name: reason}}, "seconds", "ops": {"decode": <decode result>, "prefill": <prefill result>},
     "ratios": {op: [[shape, peer, flashgen/peer], ...]}}

each op's result as its benchmark module returns it (flashgen/bench/decode.py, prefill.py: ``rows`` of one
measured call each); the ratios are rates (the peer's time over flashgen's for the same work), so above 1 means
flashgen is faster. Nothing here needs a GPU or torch.
"""

from __future__ import annotations

import json
from pathlib import Path


def _peers_in_order(ratios: list) -> list[str]:
    return sorted({peer for _, peer, _ in ratios})


def _shapes_in_order(ratios: list) -> list[str]:
    return list(dict.fromkeys(shape for shape, _, _ in ratios))


def ratio_table(op: str, ratios: list) -> str:
    """A markdown table of one op's ratios: a row a shape, a column a peer; '–' where the peer did not run."""
    if not ratios:
        return f"## {op}: flashgen / peer\n\nno peer measured\n"
    peers, shapes = _peers_in_order(ratios), _shapes_in_order(ratios)
    cell = {(shape, peer): value for shape, peer, value in ratios}
    lines = [f"## {op}: flashgen / peer (rate ratio; > 1: flashgen faster)", "",
             "| shape | " + " | ".join(peers) + " |", "|---|" + "---|" * len(peers)]
    for shape in shapes:
        values = [f"{cell[shape, p]:.2f}" if (shape, p) in cell else "–" for p in peers]
        lines.append(f"| {shape} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def run_header(run: dict) -> str:
    """The first lines of a run's markdown: where, when, what was measured against what."""
    found = ", ".join(f"{name} {version}" for name, version in run["peers"]["found"].items()) or "none"
    missing = "; ".join(f"{name}: {why}" for name, why in run["peers"]["missing"].items())
    rates = [f"copy rate {run['copy_GBps']:.0f} GB/s" if run.get("copy_GBps") else "",
             f"bf16 matmul {run['matmul_TFLOPs']:.0f} TFLOP/s" if run.get("matmul_TFLOPs") else ""]
    lines = [f"# flashgen bench, {run['device']}, {run['date']}, commit {run['commit']}",
             "; ".join(r for r in rates if r) + (f"; {run['seconds']:.0f} s" if "seconds" in run else ""),
             f"peers found: {found}" + (f"; not found: {missing}" if missing else "")]
    return "\n".join(lines) + "\n"


def markdown(run: dict, tables: dict) -> str:
    """The run's markdown: the header, each op's own table (``tables[op](result)``) and its ratio table."""
    parts = [run_header(run)]
    for op, result in run["ops"].items():
        parts += [tables[op](result), ratio_table(op, run["ratios"].get(op, []))]
    return "\n".join(parts)


def write_run(run: dict, out_dir: Path, tables: dict) -> tuple[Path, Path]:
    """``run`` as JSON and markdown in ``out_dir`` (made if missing), named bench-<ops>-<commit>-<date> as the
    saved results are; returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{'-'.join(run['ops'])}-{run['commit']}-{run['date']}"
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(run, indent=1))
    md_path.write_text(markdown(run, tables))
    return json_path, md_path


def plot_ratios(run: dict, path: Path) -> None:
    """Bars of flashgen/peer by shape, one panel per op, a bar per peer, a line at 1 (a log scale where the ratios span more than 8x), into ``path`` (its suffix
    picks the format: .png, .svg, .pdf). ImportError where matplotlib (the ``plot`` extra) is missing."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in run["ops"] if run["ratios"].get(op)]
    if not ops:
        raise ValueError("no flashgen/peer ratio to plot: no peer was measured")
    widths = [max(6.0, 0.45 * len(_shapes_in_order(run["ratios"][op])) + 2) for op in ops]
    fig, axes = plt.subplots(len(ops), 1, figsize=(max(widths), 3.6 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        ratios = run["ratios"][op]
        peers, shapes = _peers_in_order(ratios), _shapes_in_order(ratios)
        cell = {(shape, peer): value for shape, peer, value in ratios}
        width = 0.8 / len(peers)
        for i, peer in enumerate(peers):
            xs = [x + (i - (len(peers) - 1) / 2) * width for x, shape in enumerate(shapes) if (shape, peer) in cell]
            ys = [cell[shape, peer] for shape in shapes if (shape, peer) in cell]
            ax.bar(xs, ys, width=width, label=peer)
        ax.axhline(1.0, color="black", linewidth=0.8)
        values = [value for _, _, value in ratios if value > 0]
        if values and max(values) / min(values) > 8:  # one far peer would flatten every other bar
            ax.set_yscale("log", base=2)
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("flashgen / peer")
        ax.set_title(f"{op} (> 1: flashgen faster)")
        ax.legend(fontsize=7, ncol=min(len(peers), 4))
    fig.suptitle(f"flashgen bench, {run['device']}, {run['date']}, commit {run['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
