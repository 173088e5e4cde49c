"""Regression benchmarks: a fixed set of measurements compared with committed baselines.

``make bench-regress`` (run by ``.ci/run`` after the tests) measures every metric of
``rimuru.bench.regress_suite`` and compares it with ``results/baselines/regress.json``; any metric
outside its tolerance fails the step with a table (metric, baseline, now, tolerance).
``make bench-rebaseline REASON="..."`` re-measures and rewrites the baselines on purpose, recording the
commit, date, machine and reason in the file and in ``results/baselines/HISTORY.md``.

Two kinds of metric (docs/bench.md, "Regression benchmarks"):

* deterministic ones (forward steps, peak concurrency, preemptions, greedy token ids, kernel errors
  against their references) are compared exactly or against a stated bound;
* speed ones are ratios of two timings taken in the same run, interleaved (never absolute times),
  and only a slowdown beyond a wide factor fails, since CI shares a 2-core machine.

This module holds the pure part (tolerances, comparison, the table, the baseline file) and the CLI;
the measurements live in ``rimuru.bench.regress_suite``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = 1
DEFAULT_BASELINE = Path("results/baselines/regress.json")
DEFAULT_HISTORY = Path("results/baselines/HISTORY.md")
CHECKS = ("exact", "abs", "rel", "at_most", "slowdown")

Value = int | float | str


@dataclass(frozen=True)
class Tolerance:
    """How a metric may move from its baseline.

    * ``exact``: now == baseline (integers, token digests);
    * ``abs``: |now - baseline| <= value;
    * ``rel``: |now - baseline| <= value * |baseline|;
    * ``at_most``: now <= value, whatever the baseline (an error bound: kernel vs reference);
    * ``slowdown``: now <= baseline * value (a time ratio, lower is better: only slowing down fails).
    """

    check: str
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.check not in CHECKS:
            raise ValueError(f"unknown check {self.check!r}; one of {', '.join(CHECKS)}")
        if self.check != "exact" and not (self.value >= 0 and math.isfinite(self.value)):
            raise ValueError(f"{self.check} tolerance must be a finite number >= 0, got {self.value!r}")
        if self.check == "slowdown" and self.value < 1:
            raise ValueError(f"a slowdown factor below 1 would fail the baseline itself: {self.value}")

    def describe(self) -> str:
        return {
            "exact": "exact",
            "abs": f"± {_fmt(self.value)}",
            "rel": f"± {self.value:.0%}",
            "at_most": f"≤ {_fmt(self.value)}",
            "slowdown": f"≤ {self.value:g}× baseline",
        }[self.check]

    def passes(self, baseline: Value | None, now: Value) -> bool:
        if self.check == "at_most":
            return _is_number(now) and now <= self.value  # NaN compares False: fails
        if baseline is None:
            return False
        if self.check == "exact":
            return baseline == now
        if not (_is_number(baseline) and _is_number(now)):
            return False
        if self.check == "abs":
            return abs(now - baseline) <= self.value
        if self.check == "rel":
            return abs(now - baseline) <= self.value * abs(baseline)
        return now <= baseline * self.value  # slowdown

    def to_json(self) -> dict:
        return {"check": self.check, "tol": self.value}

    @classmethod
    def from_json(cls, d: dict) -> Tolerance:
        return cls(d["check"], float(d.get("tol", 0.0)))


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v))


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v == 0:
            return "0"
        return f"{v:.3g}" if abs(v) < 1e4 and abs(v) >= 1e-3 else f"{v:.2e}"
    return str(v)


@dataclass(frozen=True)
class Metric:
    """One measured value with the tolerance it is held to and a short note (unit, what it is)."""

    name: str
    value: Value
    tolerance: Tolerance
    note: str = ""


@dataclass(frozen=True)
class Row:
    name: str
    baseline: Value | None
    now: Value | None
    tolerance: str
    status: str  # ok | FAIL | missing (baseline metric not measured) | new (no baseline)
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.status != "ok"


@dataclass
class Baseline:
    """The committed baseline file: values with their tolerances, and when/why they were recorded."""

    metrics: dict[str, dict] = field(default_factory=dict)  # name -> {value, check, tol, note}
    recorded: dict = field(default_factory=dict)  # commit, date, device, reason

    @classmethod
    def load(cls, path: Path) -> Baseline:
        if not path.exists():
            raise FileNotFoundError(f"no baseline file {path}: record one with `make bench-rebaseline REASON=...`")
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA:
            raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {SCHEMA}: re-baseline")
        return cls(metrics=data["metrics"], recorded=data.get("recorded", {}))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"schema": SCHEMA, "recorded": self.recorded, "metrics": dict(sorted(self.metrics.items()))}
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def compare(baseline: dict[str, dict], measured: Iterable[Metric], groups: Sequence[str] | None = None) -> list[Row]:
    """One row per metric: measured ones against their baseline entry (its stated tolerance), plus
    baseline entries that were not measured (``missing``). ``groups`` limits the missing check to
    metric names under those prefixes (a partial run does not report the other groups missing)."""
    rows = []
    seen = set()
    for m in measured:
        seen.add(m.name)
        entry = baseline.get(m.name)
        if entry is None:
            rows.append(Row(m.name, None, m.value, m.tolerance.describe(), "new", m.note))
            continue
        tol = Tolerance.from_json(entry)
        ok = tol.passes(entry["value"], m.value)
        rows.append(Row(m.name, entry["value"], m.value, tol.describe(), "ok" if ok else "FAIL", m.note))
    for name, entry in baseline.items():
        if name in seen or (groups and not any(name.startswith(g + "/") for g in groups)):
            continue
        rows.append(Row(name, entry["value"], None, Tolerance.from_json(entry).describe(), "missing",
                        entry.get("note", "")))
    return rows


def rebaseline(old: Baseline, measured: Iterable[Metric], recorded: dict,
               groups: Sequence[str] | None = None) -> tuple[Baseline, list[Row]]:
    """New baselines from ``measured`` (replacing only the measured groups' entries when ``groups`` is
    given) and the rows that changed (old value -> new value), for the history."""
    metrics = {} if not groups else {k: v for k, v in old.metrics.items()
                                     if not any(k.startswith(g + "/") for g in groups)}
    changed = []
    for m in measured:
        metrics[m.name] = {"value": m.value, **m.tolerance.to_json(), "note": m.note}
        prev = old.metrics.get(m.name)
        if prev is None or prev["value"] != m.value:
            changed.append(Row(m.name, None if prev is None else prev["value"], m.value, m.tolerance.describe(),
                               "new" if prev is None else "changed", m.note))
    for name in set(old.metrics) - set(metrics):
        changed.append(Row(name, old.metrics[name]["value"], None, "", "dropped"))
    return Baseline(metrics=metrics, recorded=recorded), changed


def render(rows: Sequence[Row], title: str = "") -> str:
    """A plain-text table (fixed-width columns) that reads the same in a CI log and in Markdown."""
    head = ("metric", "baseline", "now", "tolerance", "status", "note")
    body = [(r.name, _fmt(r.baseline), _fmt(r.now), r.tolerance, r.status, r.note) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    out = [title] if title else []
    out += [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(b) for b in body)]
    return "\n".join(out)


def history_entry(recorded: dict, changed: Sequence[Row]) -> str:
    lines = [f"## {recorded['date']} — commit {recorded['commit']}", "",
             f"Reason: {recorded['reason']}", "", f"Machine: {recorded['device']}", ""]
    if changed:
        lines += [render(changed), ""]
    else:
        lines += ["No value changed.", ""]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ CLI
def _recorded(reason: str) -> dict:
    from rimuru.provenance import provenance

    p = provenance()
    return {"commit": p["commit"], "date": p["date"], "device": p["device"], "reason": reason}


def _measure(groups: Sequence[str] | None, workdir: Path | None) -> tuple[list[Metric], dict[str, float]]:
    from rimuru.bench import regress_suite

    return regress_suite.measure(groups, workdir=workdir)


def main(argv: list[str] | None = None) -> int:
    import os

    # A CPU suite on every machine: the kernels run under Triton's interpreter (set before triton loads)
    # and the engine on the CPU, so that the baselines mean the same thing wherever they are checked.
    os.environ["TRITON_INTERPRET"] = "1"
    from rimuru.bench.regress_suite import GROUPS

    ap = argparse.ArgumentParser(prog="python -m rimuru.bench.regress", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, default=DEFAULT_BASELINE)
    ap.add_argument("--group", action="append", choices=list(GROUPS),
                    help="measure only this group (repeatable; default: all)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the pipeline group runs snakemake (default: a temporary folder)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="measure and compare with the baselines; exit 1 on a regression")
    rb = sub.add_parser("rebaseline", help="measure and rewrite the baselines (records commit and reason)")
    rb.add_argument("--reason", required=True, help="why the baselines change (kept in HISTORY.md)")
    rb.add_argument("--history", type=Path, default=DEFAULT_HISTORY)
    args = ap.parse_args(argv)
    if args.command == "rebaseline" and not args.reason.strip():
        ap.error("--reason must say why the baselines change")
    groups = args.group or None
    try:
        old = Baseline.load(args.baseline) if args.command == "check" or args.baseline.exists() else Baseline()
    except (FileNotFoundError, ValueError) as exc:
        print(f"bench-regress: error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    measured, timings = _measure(groups, args.workdir)
    took = ", ".join(f"{g} {s:.0f} s" for g, s in timings.items())
    print(f"measured {len(measured)} metrics in {time.perf_counter() - t0:.0f} s ({took})")
    if args.command == "rebaseline":
        new, changed = rebaseline(old, measured, _recorded(args.reason.strip()), groups)
        new.save(args.baseline)
        with args.history.open("a") as f:
            if args.history.stat().st_size == 0:
                f.write("# Regression baseline history\n\nAppended by `make bench-rebaseline` "
                        "(python -m rimuru.bench.regress rebaseline).\n\n")
            f.write(history_entry(new.recorded, changed))
        print(render(changed, f"re-baselined {args.baseline} ({len(changed)} values changed):") if changed
              else f"re-baselined {args.baseline}: no value changed")
        return 0
    rows = compare(old.metrics, measured, groups)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1, default=str) + "\n")
    rec = old.recorded
    print(render(rows, f"baselines: {args.baseline} (commit {rec.get('commit')}, {rec.get('date')}: "
                       f"{rec.get('reason')})"))
    failed = [r for r in rows if r.failed]
    if failed:
        print()
        changed_set = any(r.status in ("new", "missing") for r in failed)
        print(render(failed, f"REGRESSION: {len(failed)} of {len(rows)} metrics outside their tolerance"
                             + (" (new/missing: the metric set changed)" if changed_set else "")
                             + "; a change that moves them on purpose: make bench-rebaseline REASON=..."))
        return 1
    print(f"bench-regress: all {len(rows)} metrics within tolerance "
          f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
