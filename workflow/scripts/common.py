"""Helpers shared by the pipeline scripts: thread settings, a system's engine options and budget, tables.

Scripts run as ``python workflow/scripts/X.py`` so this module is importable as ``common``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

NOT_MEASURED = "not measured yet"


def single_thread() -> None:
    """One intra-op thread per job: snakemake runs jobs side by side, and torch's OpenMP pool
    spin-waits badly when cores are oversubscribed (a 0.3 s step became 40 s on a loaded 2-core box)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------- budgets
# ---------------------------------------------------------------------------------------------- engines
def engine_options(engine_kwargs: dict, overrides: list[str], hotset: str | None) -> dict:
    """A system's LLM(...) options with ``--engine-option KEY=VALUE`` overrides (JSON values; none/null
    -> None) and an optional hotset profile."""
    options = dict(engine_kwargs)
    for kv in overrides:
        key, _, value = kv.partition("=")
        options[key] = None if value in ("none", "null") else json.loads(value)
    if hotset:
        options["hotset"] = hotset
    return options


def system_budget(args) -> tuple:
    """(baseline, engine options, activation bytes, scaled budget) of a run script's ``--system``,
    ``--engine-option``, ``--hotset``, ``--activation-mib`` and real-card arguments."""
    from rimuru.baselines import load_baseline
    from rimuru.engine.memory_policy import mini_model_budget

    system = load_baseline(args.system)
    options = engine_options(system.engine_kwargs, args.engine_option, args.hotset)
    act = int(args.activation_mib * 2**20)
    scaling = mini_model_budget(args.model_dir, args.real_config, args.card_gib, system.memory_fraction,
                                options["policy"], args.real_activation_gib, act)
    return system, options, act, scaling


def make_engine(model_dir: str | Path, budget: int, activation_bytes: int, engine_kwargs: dict, **extra):
    """The real engine on the CPU in fp32; a model without tokenizer gets Qwen ids folded into its vocabulary."""
    import torch

    from rimuru.engine.llm import LLM

    options = dict(engine_kwargs) | extra
    options.setdefault("tokenizer", "qwen-folded")
    return LLM(model_dir, gpu_memory_budget=budget, device="cpu", dtype=torch.float32,
               activation_reserve=activation_bytes, **options)


# ---------------------------------------------------------------------------------------------- tables
def write_table(frame, csv_path: str | Path, md_path: str | Path, title: str, notes: list[str] | None = None) -> None:
    """CSV plus a Markdown rendering (title, table, notes)."""
    csv_path, md_path = Path(csv_path), Path(md_path)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(csv_path, index=False)
    lines = [f"# {title}", "", markdown(frame), ""]
    lines += [f"* {n}" for n in notes or []]
    md_path.write_text("\n".join(lines).rstrip() + "\n")


def markdown(frame) -> str:
    def cell(v) -> str:
        if isinstance(v, float):
            if math.isnan(v):
                return ""
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v).replace("|", "\\|")

    head = "| " + " | ".join(map(str, frame.columns)) + " |"
    sep = "|" + "|".join("---" for _ in frame.columns) + "|"
    rows = ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([head, sep, *rows])


def reference_source(frame_row: dict, path: str | Path) -> str:
    """'H200 measured (reference file X, commit C, date D)' for a row read from results/reference/."""
    device = frame_row.get("device", "GPU")
    commit = frame_row.get("commit", "unknown")
    run = frame_row.get("run")
    where = f"{Path(path).name} {run}" if isinstance(run, str) and run else Path(path).name
    return f"{device} measured (reference {where}, commit {commit})"


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def save_figure(fig, path: str | Path, tight: bool = True) -> None:
    """Write a PNG (creating its folder) and close the figure."""
    import matplotlib.pyplot as plt

    if tight:
        fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure_note(ax, text: str) -> None:
    """A placeholder panel that says why it is empty."""
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, transform=ax.transAxes, fontsize=11)
    ax.set_axis_off()
