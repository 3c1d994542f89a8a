"""The scale curve: ``replicas.py`` over a grid of sweeps x replicas x tick shapes.

    python benchmarks/scale.py [--sweeps 10,100,1000,10000] [--replicas 1,3,8]
        [--shapes aligned,spread] [--dialect postgresql] [--interval DURATION]
        [--concurrency N] [--seconds 30] [--out scale-results]
    python benchmarks/scale.py --report-only [--out scale-results]

Each grid point is one ``replicas.py --json`` subprocess, not a call into it: a fresh
interpreter, replicas and database per point, so nothing of one point (threads, engines, a
replica slow to stop) is in the next one's figures, and a point that fails is logged while the
grid goes on. Its full text report goes to ``OUT/reports/``; its JSON line to
``OUT/results.jsonl``, which is only ever appended to: a grid can be run in parts, and the
table and plots take the latest line of each point (dialect, concurrency, S, R, shape).

The interval, unless ``--interval`` sets one for every S: 1 s below 1,000 sweeps, 10 s from
1,000 on. 10,000 every 10 s is the aim's own point (1,000 runs a second); below it the rate stays
at most 100 runs a second, which fits 2 cores even at several ms per run (spread ticks, each
claimed on its own, cost the most), so those points measure the cost of a run, not a backlog.
The short interval for few sweeps gives the window more ticks to measure.

Written to OUT: ``table.md`` (also printed), ``cpu-per-run.png``, ``lateness-p99.png`` and
``burst-drain.png`` (aligned points: measured next to N x CPU per run / cores, N = S), drawn by
matplotlib in compare.py's virtualenv for it. CPU per run is replica + database CPU seconds over
the window divided by its runs; the database's is the whole server's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import replicas  # the benchmark each point runs: its tables, parsers and load average
from compare import CACHE  # its virtualenv for matplotlib, shared

from sweepd.durations import format_duration

HERE = Path(__file__).resolve().parent
SHAPES = ("aligned", "spread")
MATPLOTLIB = "matplotlib==3.10.8"  # compare.py's pin
AIM_SWEEPS, AIM_REPLICAS = 10_000, 3  # "10,000 sweeps every 10 s on 3 replicas"
AIM_P99_MS, AIM_CPU_MS = 100.0, 0.5


def interval_for(sweeps: int, chosen: timedelta | None) -> timedelta:
    return chosen or timedelta(seconds=1 if sweeps < 1000 else 10)


def run_point(args: argparse.Namespace, sweeps: int, count: int, shape: str, results: Path) -> bool:
    """One grid point through replicas.py; its report into OUT/reports/."""
    interval = interval_for(sweeps, args.interval)
    command = [
        sys.executable,
        str(HERE / "replicas.py"),
        "--dialect",
        args.dialect,
        "--replicas",
        str(count),
        "--sweeps",
        str(sweeps),
        "--interval",
        format_duration(interval),
        "--seconds",
        f"{args.seconds:g}",
        # Two intervals before the window: every sweep's first claim (an INSERT,
        # one at a time) and its first run's metric series are behind it, which
        # at 10,000 sweeps would otherwise be most of a 20 s window's cost.
        "--warmup",
        f"{3 + 2 * interval.total_seconds():g}",
        "--json",
        str(results),
        *(["--spread"] if shape == "spread" else []),
        *(["--concurrency", str(args.concurrency)] if args.concurrency is not None else []),
    ]
    tuned = "" if args.concurrency is None else f"-c{args.concurrency}"
    report = args.out / "reports" / f"{args.dialect}-S{sweeps}-R{count}-{shape}{tuned}.txt"
    with report.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        print(f"  failed ({done.returncode}): see {report}", file=sys.stderr, flush=True)
    return done.returncode == 0


def latest(results: Path) -> list[dict[str, Any]]:
    """The last line of each point, in grid order."""
    points: dict[tuple[int, int, bool, str, int], dict[str, Any]] = {}
    for line in results.read_text().splitlines() if results.exists() else []:
        point = json.loads(line)
        c = point["config"]
        # Concurrency 0 stands for sweepd's own default, which sorts first.
        key = (c["sweeps"], c["replicas"], c["spread"], c["dialect"], c["concurrency"] or 0)
        points[key] = point
    return [points[key] for key in sorted(points)]


def shape_of(point: dict[str, Any]) -> str:
    return "spread" if point["config"]["spread"] else "aligned"


def predicted_drain_ms(point: dict[str, Any]) -> float | None:
    """N x CPU per run / cores: a burst's work spread over every core, nothing else."""
    total = point["derived"]["cpu_per_run_ms"]["total"]
    if point["config"]["spread"] or total is None:
        return None
    return float(point["config"]["sweeps"] * total / point["config"]["cores"])


def number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(points: list[dict[str, Any]]) -> replicas.Table:
    out = replicas.Table(
        "Scale curve",
        [
            "S", "R", "shape", "interval", "dialect", "run / expected", "dup", "missed",
            "lateness p50 / p99 ms", "CPU per run ms (replica + db)", "peak RSS MiB",
            "SQL per run", "burst drain p50 ms (N x CPU per run / cores)", "other load (cores)",
        ],
    )  # fmt: skip
    for point in points:
        c, r, cpu = point["config"], point["results"], point["derived"]["cpu_per_run_ms"]
        drain = r["burst_drain_p50_ms"]
        other = r["machine_busy_s"] - r["cpu_s_total"] - (r["db_cpu_s"] or 0)
        tuned = "" if c["concurrency"] is None else f", concurrency {c['concurrency']}"
        out.add(
            c["sweeps"], c["replicas"], shape_of(point),
            format_duration(timedelta(seconds=c["interval_s"])), c["dialect"] + tuned,
            f"{r['run']} / {r['expected']}", r["duplicated"], r["missed"],
            f"{number(r['lateness_p50_ms'])} / {number(r['lateness_p99_ms'])}",
            f"{number(cpu['replica'], 2)} + {number(cpu['db'], 2)} = {number(cpu['total'], 2)}",
            f"{max(r['peak_rss_mib']):.0f}", number(r.get("sql_per_run_whole_life"), 2),
            "-" if drain is None else f"{drain:.0f} ({number(predicted_drain_ms(point), 0)})",
            f"{other / c['seconds']:.2f}",
        )  # fmt: skip
    out.notes.append(
        "CPU per run: CPU seconds over the window / its runs, the replicas' and the database"
        " server's (all of it, so other users' queries count too). Burst drain: an aligned"
        " tick's first run start to its last, p50 over the window's ticks. Peak RSS: the largest"
        " replica's. SQL per run: PostgreSQL's commits over the replicas' whole lives (every"
        " statement, claims lost to other replicas and pings included) / the runs. Other load:"
        " the rest of the machine's busy CPU, on average; well above zero, the point was not"
        " measured on a quiet machine."
    )
    return out


def aim(points: list[dict[str, Any]]) -> list[str]:
    """The project's aim, for the points of it that were measured."""
    lines = []
    for point in points:
        c, r = point["config"], point["results"]
        if (c["sweeps"], c["replicas"], c["dialect"]) != (AIM_SWEEPS, AIM_REPLICAS, "postgresql"):
            continue
        once = r["duplicated"] == 0 and r["missed"] == 0
        who = f"aim, {shape_of(point)}" + (
            "" if c["concurrency"] is None else f", concurrency {c['concurrency']}"
        )
        if c["spread"]:
            p99 = r["lateness_p99_ms"]
            ok = once and p99 is not None and p99 < AIM_P99_MS
            lines.append(
                f"{who}: every tick once and p99 < {AIM_P99_MS:g} ms:"
                f" {'yes' if ok else 'NO'} (dup {r['duplicated']}, missed {r['missed']},"
                f" p99 {number(p99)} ms)"
            )
        else:
            total = point["derived"]["cpu_per_run_ms"]["total"]
            ok = once and total is not None and total < AIM_CPU_MS
            lines.append(
                f"{who}: every tick once and CPU per run < {AIM_CPU_MS:g} ms:"
                f" {'yes' if ok else 'NO'} ({number(total, 2)} ms); burst drain p50"
                f" {number(r['burst_drain_p50_ms'], 0)} ms vs N x CPU per run / cores"
                f" {number(predicted_drain_ms(point), 0)} ms"
            )
    return lines


def plot(points: list[dict[str, Any]], folder: Path) -> None:
    """The PNGs, drawn by scale/plots.py in the matplotlib virtualenv (made if missing)."""
    venv = CACHE / "plots"
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", MATPLOTLIB]
        subprocess.run(pip, check=True)
    # Lines are per R and shape; the dialect and concurrency join the label only when they vary.
    varies = len({(p["config"]["dialect"], p["config"]["concurrency"]) for p in points}) > 1
    lines = [
        {
            "label": f"R={p['config']['replicas']} {shape_of(p)}"
            + (
                f" {p['config']['dialect']}, concurrency {p['config']['concurrency'] or 'default'}"
                if varies
                else ""
            ),
            "sweeps": p["config"]["sweeps"],
            "replicas": p["config"]["replicas"],
            "shape": shape_of(p),
            "cpu_per_run_ms": p["derived"]["cpu_per_run_ms"]["total"],
            "lateness_p99_ms": p["results"]["lateness_p99_ms"],
            "drain_ms": p["results"]["burst_drain_p50_ms"],
            "predicted_drain_ms": predicted_drain_ms(p),
        }
        for p in points
    ]
    seen = {
        key: sorted({p["config"][key] for p in points}) for key in ("dialect", "seconds", "cores")
    }
    title = (
        f"{'/'.join(seen['dialect'])}, {'/'.join(f'{s:g}' for s in seen['seconds'])} s windows,"
        f" {'/'.join(map(str, seen['cores']))} cores"
    )
    subprocess.run(
        [str(venv / "bin" / "python"), str(HERE / "scale" / "plots.py"), str(folder)],
        input=json.dumps({"title": title, "aims": [AIM_CPU_MS, AIM_P99_MS], "points": lines}),
        text=True,
        check=True,
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    def numbers(value: str) -> list[int]:
        return [int(part) for part in value.split(",")]

    def shapes(value: str) -> list[str]:
        chosen = value.split(",")
        if set(chosen) - set(SHAPES):
            raise argparse.ArgumentTypeError(f"shapes are {', '.join(SHAPES)}")
        return chosen

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--sweeps", type=numbers, default=[10, 100, 1000, 10_000], help="S, comma-separated"
    )
    parser.add_argument("--replicas", type=numbers, default=[1, 3, 8], help="R, comma-separated")
    parser.add_argument(
        "--shapes", type=shapes, default=list(SHAPES), help="aligned (one burst), spread"
    )
    parser.add_argument("--dialect", choices=replicas.DIALECTS, default="postgresql")
    parser.add_argument(
        "--interval",
        type=replicas.duration,
        help="for every S (default: 1 s below 1,000 sweeps, else 10 s)",
    )
    parser.add_argument(
        "--concurrency", type=int, help="the replicas' concurrency (default: sweepd's own)"
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="each point's window")
    parser.add_argument(
        "--out", type=Path, default=Path("scale-results"), help="results, table, plots, reports"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="no runs: the table and plots of OUT's results"
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    (args.out / "reports").mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    grid = [
        (sweeps, count, shape)
        for sweeps in args.sweeps
        for count in args.replicas
        for shape in args.shapes
    ]
    failed = 0
    began = time.monotonic()
    for n, (sweeps, count, shape) in enumerate([] if args.report_only else grid, 1):
        interval = format_duration(interval_for(sweeps, args.interval))
        print(
            f"[{n}/{len(grid)}] S={sweeps} R={count} {shape} every {interval}"
            f" ({time.monotonic() - began:.0f} s in, {replicas.load()})",
            file=sys.stderr,
            flush=True,
        )
        failed += not run_point(args, sweeps, count, shape, results)
    points = latest(results)
    if not points:
        print(f"no results in {results}", file=sys.stderr)
        return 1
    verdicts = aim(points)
    text = table(points).markdown() + ("\n\n" + "\n".join(verdicts) if verdicts else "")
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    plot(points, args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
