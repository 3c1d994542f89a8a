"""Charts of benchmarks/scale.py's grid: one PNG per figure, a line per R and shape.

Run by scale.py with matplotlib's own virtualenv: ``python plots.py OUT`` with the points as
JSON on standard input.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no screen
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

Point = dict[str, Any]


def colour(lines: dict[str, list[Point]], point: Point) -> str:
    """One colour per R, so that a shape is told by its line style (spread: dashed)."""
    counts = sorted({points[0]["replicas"] for points in lines.values()})
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return str(cycle[counts.index(point["replicas"]) % len(cycle)])


def chart(
    lines: dict[str, list[Point]],
    key: str,
    ylabel: str,
    title: str,
    aim: float,
    path: Path,
    log_y: bool = False,
) -> Path:
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for label, points in lines.items():
        shown = [p for p in points if p[key] is not None]
        axis.plot(
            [p["sweeps"] for p in shown],
            [p[key] for p in shown],
            "--" if points[0]["shape"] == "spread" else "-",
            color=colour(lines, points[0]),
            marker="o",
            label=label,
        )
    axis.axhline(aim, color="grey", linestyle=":", label=f"aim {aim:g}")
    if log_y:
        axis.set_yscale("log")  # from a fraction of a millisecond to seconds
    return finish(figure, axis, "sweeps (S)", ylabel, title, path)


def drain_chart(lines: dict[str, list[Point]], title: str, path: Path) -> Path | None:
    """Aligned bursts: measured drain (solid) next to N x CPU per run / cores (dotted)."""
    aligned = {label: points for label, points in lines.items() if points[0]["shape"] == "aligned"}
    if not aligned:
        return None
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for label, points in aligned.items():
        shown = [p for p in points if p["drain_ms"] is not None]
        sweeps = [p["sweeps"] for p in shown]
        hue = colour(lines, points[0])
        axis.plot(sweeps, [p["drain_ms"] for p in shown], color=hue, marker="o", label=label)
        predicted = [p["predicted_drain_ms"] for p in shown]
        axis.plot(sweeps, predicted, ":", color=hue, label=f"{label}, N x CPU / cores")
    axis.set_yscale("log")
    return finish(
        figure, axis, "sweeps (S = N ticks per burst)", "burst drain p50 (ms)", title, path
    )


def finish(figure: Figure, axis: Axes, xlabel: str, ylabel: str, title: str, path: Path) -> Path:
    axis.set_xscale("log")  # S from 10 to 10,000
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(title, fontsize="medium")
    axis.legend(fontsize="small")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(folder: Path) -> int:
    data = json.load(sys.stdin)
    lines: dict[str, list[Point]] = defaultdict(list)
    for point in sorted(data["points"], key=lambda p: p["sweeps"]):
        lines[point["label"]].append(point)
    cpu_aim, p99_aim = data["aims"]
    title = data["title"]
    paths = [
        chart(
            lines,
            "cpu_per_run_ms",
            "CPU per run (ms, replicas + database)",
            f"CPU per run: {title}",
            cpu_aim,
            folder / "cpu-per-run.png",
            log_y=True,
        ),
        chart(
            lines,
            "lateness_p99_ms",
            "lateness p99 (ms)",
            f"Lateness p99: {title}",
            p99_aim,
            folder / "lateness-p99.png",
            log_y=True,
        ),
        drain_chart(lines, f"Aligned burst drain: {title}", folder / "burst-drain.png"),
    ]
    for path in paths:
        if path is not None:
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
