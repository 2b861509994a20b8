"""``trustbatch report RUN_DIR [RUN_DIR ...] --out DIR``: several runs overlaid in one figure, and a short Markdown
page: the configuration keys in which they differ, base, final and best held-out accuracy, wall time, world size.

Reads what ``trustbatch train`` leaves in a run directory (``metrics.jsonl``, ``config.yaml``, ``summary.json``,
``segments.jsonl``); writes ``OUT/README.md`` and ``OUT/runs.png``. Runs of any commit compare: a panel or a
column is drawn for the metrics that some run logged.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..config import _flatten, read_yaml_file  # _flatten: the dotted keys overrides use
from ..errors import UserError
from ..records import atomic_write, read_metrics
from .outputs import output_folder

HELDOUT, HELDOUT_SE = "heldout_accuracy", "heldout_accuracy_se"
# (metrics key, panel title); a panel is drawn when at least one run logged its key
PANELS = [
    ("reward_mean", "train reward (mean)"),
    (HELDOUT, "held-out mean reward (± standard error; pass@1 for 0/1 rewards)"),
    ("ess", "batch ESS"),
    ("kl_behavior", "KL term to the behaviour (objective.options.kl's estimator; k3 by default)"),
    ("kl_behavior_bound", "KL to the behaviour, top-k lower bound (vLLM)"),
    ("kl_ref", "KL to the reference"),
    ("clip_fraction", "clip fraction"),
    ("cap_fraction", "cap fraction (P3O)"),
    ("response_length", "response length (tokens)"),
    ("tokens_per_s", "completion tokens / s of the whole round"),
]
FIGURE = "runs.png"
PAGE_TITLE = "# Run comparison"  # the first line of every page: what a later report may replace


@dataclass
class Run:
    """One run directory as read: its records (``metrics.jsonl``), resolved config (dotted keys), summary."""

    path: Path
    label: str
    records: list[dict]
    config: dict
    summary: dict | None
    segments: int = 1
    evals: list[dict] = field(init=False)

    def __post_init__(self):
        self.evals = [r for r in self.records if _finite(r.get(HELDOUT))]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def load_run(path: Path, label: str) -> Run:
    """Read a run directory of ``trustbatch train``.

    Raises:
        UserError: the directory has no ``metrics.jsonl`` or no ``config.yaml`` (not a run directory), or its
            ``config.yaml`` is not a mapping.
    """
    path = Path(path)
    for name in ("metrics.jsonl", "config.yaml"):
        if not (path / name).is_file():
            raise UserError(f"{str(path)!r} has no {name}: not a trustbatch run directory; pass directories that "
                            "`trustbatch train` wrote (their run_dir)")
    cfg = read_yaml_file(path / "config.yaml", what="the run's config")
    if not isinstance(cfg, dict):
        raise UserError(f"{str(path / 'config.yaml')!r} is not a mapping of sections; restore it from the run")
    summary = _summary(path / "summary.json")
    seg = path / "segments.jsonl"
    segments = sum(1 for line in seg.read_text().splitlines() if line.strip()) if seg.is_file() else 1
    return Run(path, label, read_metrics(path / "metrics.jsonl"), _flatten(cfg), summary, max(segments, 1))


def _summary(path: Path) -> dict | None:
    """A run's summary.json, or None where it is missing or unreadable (a torn copy): the run reads as unfinished,
    as a resume reads it (``train._summary_steps``)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    return summary if isinstance(summary, dict) else None


def labels(paths: list[Path]) -> list[str]:
    """Shortest unique trailing parts of the paths (``a/seed0`` and ``b/seed0`` when the names repeat).

    Raises:
        UserError: the same directory is given twice.
    """
    parts = [Path(p).resolve().parts for p in paths]
    if len(set(parts)) < len(parts):
        raise UserError("a run directory is given twice; name each run once")
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]  # not reached: distinct paths differ at some depth


def config_differences(runs: list[Run]) -> dict[str, list]:
    """Dotted config key -> each run's value, for the keys whose values are not all equal (``run_dir`` aside; a key
    a run's config lacks, from an older commit, is ``None`` there and counts as a difference). A section that is null
    in one run and set in another (``model.lora``) shows as its keys' rows alone: the set run has no value of its own
    under the section's name, so that row would read ``null`` for every run."""
    keys = {k for r in runs for k in r.config} - {"run_dir"}
    sections = {k.rpartition(".")[0] for k in keys}
    keys = sorted(k for k in keys if k not in sections)
    absent = object()
    out = {}
    for k in keys:
        values = [r.config.get(k, absent) for r in runs]
        if any(v != values[0] for v in values[1:]):
            out[k] = [None if v is absent else v for v in values]
    return out


def _series(run: Run, key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in run.records if _finite(r.get(key)) and "step" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_runs(runs: list[Run], path: Path) -> list[str]:
    """Write one figure with a panel per metric that some run logged, every run overlaid (the held-out panel with
    a ± 1 standard-error band where the run logged ``heldout_accuracy_se``). Returns the panels' metric keys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [(k, t) for k, t in PANELS if any(_series(r, k)[0] for r in runs)]
    if not panels:
        raise UserError(f"the runs logged none of {', '.join(k for k, _ in PANELS)}; nothing to plot")
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title) in zip(axes.flat, panels):
        for i, run in enumerate(runs):
            x, y = _series(run, key)
            color = colors[i % len(colors)]
            ax.plot(x, y, lw=1.2, color=color, label=run.label, marker="o" if key == HELDOUT else None, ms=3)
            if key == HELDOUT:
                band = [(r["step"], r[HELDOUT], r[HELDOUT_SE]) for r in run.evals if _finite(r.get(HELDOUT_SE))]
                if band:
                    bx, m, se = zip(*band)
                    ax.fill_between(bx, [a - b for a, b in zip(m, se)], [a + b for a, b in zip(m, se)],
                                    color=color, alpha=0.2, lw=0)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("rollout round", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.ticklabel_format(axis="y", useOffset=False)
        if key == "ess":  # ESS lives in [0, 1]; autoscale would draw 1 − 1e-14 jitter as a trend
            ax.set_ylim(0.0, 1.02)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(len(runs), 4), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 if rows > 1 else 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()  # rendered whole, then renamed in: a failed write leaves the old figure, never half a PNG
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(path, buf.getvalue())
    return [k for k, _ in panels]


def _acc(rec: dict | None) -> str:
    if rec is None:
        return "—"
    se = rec.get(HELDOUT_SE)
    return f"{rec[HELDOUT]:.3f}" + (f" ± {se:.3f}" if _finite(se) else "") + f" (round {rec['step']})"


def duration(seconds: float) -> str:
    """A wall time as read in the table: seconds below a minute (one decimal below 10 s), else minutes with one
    decimal; a run of a few seconds read "0.0 min" in minutes alone. The thresholds sit where rounding would
    otherwise print "10.0 s" or "60 s"."""
    if seconds < 9.95:
        return f"{seconds:.1f} s"
    if seconds < 59.5:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min"


def _wall(run: Run) -> str:
    if run.summary is None or not _finite(run.summary.get("wall_s")):
        return "unfinished (no summary.json)"
    text = duration(run.summary["wall_s"])
    if run.segments == 1:
        return text
    # summaries that name the world size count every segment's time; older ones only the last segment's
    return text + (f" ({run.segments} segments)" if "world_size" in run.summary else
                   f" (the last of {run.segments} segments)")


def _world(run: Run) -> str:
    size = (run.summary or {}).get("world_size")
    return str(size) if isinstance(size, int) else "—"


def _value(v) -> str:
    return "`" + (json.dumps(v) if not isinstance(v, str) else v).replace("|", "\\|") + "`"


def report_markdown(runs: list[Run], figure: str | None = FIGURE) -> str:
    """The page: the runs, the config keys in which they differ (one row each), then base / final / best held-out
    accuracy (± standard error when logged), wall time and world size (data-parallel ranks) per run."""
    lines = [PAGE_TITLE, ""]
    lines += [f"- **{r.label}**: `{r.path}`" for r in runs] + [""]
    if figure:
        lines += [f"![runs]({figure})", ""]
    diff = config_differences(runs)
    lines += ["## Configuration differences", ""]
    if diff:
        lines += ["| key | " + " | ".join(r.label for r in runs) + " |", "|---" * (len(runs) + 1) + "|"]
        lines += [f"| `{k}` | " + " | ".join(_value(v) for v in vals) + " |" for k, vals in diff.items()]
    else:
        lines += ["The resolved configurations are identical (run_dir aside)."]
    lines += ["", "## Held-out accuracy (mean reward: pass@1 for 0/1 rewards) and wall time", "",
              "| run | rounds | base | final | best | wall time | world size |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        steps = [rec["step"] for rec in r.records if "step" in rec]
        best = max(r.evals, key=lambda rec: rec[HELDOUT]) if r.evals else None  # the first of equal maxima
        base = r.evals[0] if r.evals and r.evals[0]["step"] == 0 else None
        lines.append(f"| {r.label} | {max(steps) if steps else 0} | {_acc(base)} | "
                     f"{_acc(r.evals[-1] if r.evals else None)} | {_acc(best)} | {_wall(r)} | {_world(r)} |")
    lines += ["", "Best is the highest held-out evaluation of the run (chosen after the fact: an optimistic number); "
              "± is the standard error over held-out prompts where the run logged it."]
    return "\n".join(lines) + "\n"


def write_comparison(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Read the run directories, write ``OUT/runs.png`` and ``OUT/README.md``; returns the page's path.

    Raises:
        UserError: no run directory, one given twice, or one without ``metrics.jsonl`` / ``config.yaml``; the
            runs logged none of the plotted metrics; ``out`` is a file, lies inside one, or cannot be created or
            written (``outputs.output_folder``), or a write there fails (a full disk: the earlier report's files are
            kept whole); ``out`` holds a README.md that is not an earlier report's.
    """
    if not run_dirs:
        raise UserError("give at least one run directory: trustbatch report RUN_DIR [RUN_DIR ...] --out DIR")
    paths = [Path(p) for p in run_dirs]
    runs = [load_run(p, name) for p, name in zip(paths, labels(paths))]
    out = output_folder(out)
    page = out / "README.md"
    # the page replaces an earlier report's, never a README of the user's (a project root given as --out)
    if page.exists() and not page.read_text(encoding="utf-8", errors="replace").startswith(PAGE_TITLE):
        raise UserError(f"--out {str(out)!r} holds a README.md that is no run comparison; give a new or empty "
                        "directory, or a previous report's")
    try:
        plot_runs(runs, out / FIGURE)
        atomic_write(page, report_markdown(runs))
    except OSError as e:
        raise UserError(f"cannot write the report into {str(out)!r} ({e.strerror or e}); free space there or give "
                        "another --out") from None
    return page
