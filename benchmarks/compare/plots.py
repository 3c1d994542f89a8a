"""Charts of benchmarks/compare.py's results: one PNG per scenario, beside the JSON.

Run by the harness with matplotlib's own virtualenv: ``python plots.py results.json``.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no screen
import matplotlib.pyplot as plt

PANELS = (
    ("lateness (ms)", ("lateness_p50_ms", "lateness_p99_ms"), ("p50", "p99")),
    (
        "ticks",
        ("duplicates", "missed", "missed_in_takeover", "coalesced"),
        ("extra runs", "nobody ran", "nobody ran, in takeover", "coalesced"),
    ),
    ("CPU s per replica", ("cpu_s_per_replica",), ("window",)),
    ("DB commits per run", ("commits_per_run",), ("commits",)),
)


def chart(scenario: str, results: list[dict[str, object]], folder: Path) -> Path:
    systems = [str(r["system"]) for r in results]
    figure, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6))
    for axis, (title, keys, labels) in zip(axes, PANELS, strict=True):
        width = 0.8 / len(keys)
        for k, (key, label) in enumerate(zip(keys, labels, strict=True)):
            values = [float(r[key]) for r in results]  # type: ignore[arg-type]
            axis.bar([i + k * width for i in range(len(systems))], values, width, label=label)
        axis.set_title(title)
        if title.startswith("lateness"):
            axis.set_yscale("log")  # from a millisecond to seconds
        axis.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(systems))])
        axis.set_xticklabels(systems, rotation=30, ha="right")
        if len(keys) > 1:
            axis.legend(fontsize="small")
    first = results[0]
    figure.suptitle(
        f"{scenario}: {first['replicas']} replicas x {first['sweeps']} sweeps"
        f" every {first['interval']:g} s, {first['seconds']:g} s window"
    )
    figure.tight_layout()
    path = folder / f"compare-{scenario}.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(path: str) -> int:
    results = json.loads(Path(path).read_text())
    by_scenario: dict[str, list[dict[str, object]]] = defaultdict(list)
    for result in results:
        by_scenario[result["scenario"]].append(result)
    for scenario, found in by_scenario.items():
        print(chart(scenario, found, Path(path).parent))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
