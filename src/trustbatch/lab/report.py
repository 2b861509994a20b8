"""``trustbatch lab report``: curves with seed bands, ESS/KL traces, ratio histograms, a results table, findings.

Everything in the report is computed from the run directories; the findings are rules applied to
the numbers (a difference counts only when it exceeds two standard errors), not hand-written.
"""

from __future__ import annotations

import json
import math
import subprocess
from datetime import datetime
from pathlib import Path

import yaml

from ..errors import UserError
from ..trainer.runlog import atomic_write, read_metrics

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _mean_se(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def load_runs(exp_dir: Path) -> dict[str, list[dict]]:
    """{arm: [run, ...]} for the finished runs; a run is {"seed", "metrics", "ratios", "summary"}."""
    arms: dict[str, list[dict]] = {}
    spec = yaml.safe_load((exp_dir / "experiment.yaml").read_text()) if (exp_dir / "experiment.yaml").exists() else {}
    order = list((spec or {}).get("arms", {})) or sorted(p.name for p in exp_dir.iterdir() if p.is_dir())
    for arm in order:
        for run in sorted((exp_dir / arm).glob("seed*/summary.json")):
            d = run.parent
            ratios = [json.loads(line) for line in (d / "ratios.jsonl").read_text().splitlines()] if (d / "ratios.jsonl").exists() else []
            arms.setdefault(arm, []).append({
                "seed": int(d.name.removeprefix("seed")), "metrics": read_metrics(d / "metrics.jsonl"),
                "ratios": ratios, "summary": json.loads(run.read_text()),
            })
    return arms


def _series(runs: list[dict], key: str) -> tuple[list[int], list[float], list[float]]:
    steps = sorted({r["step"] for run in runs for r in run["metrics"] if key in r})
    mean, se = [], []
    for s in steps:
        m, e = _mean_se([r[key] for run in runs for r in run["metrics"] if r["step"] == s and key in r])
        mean.append(m)
        se.append(0.0 if math.isnan(e) else e)
    return steps, mean, se


def _smooth(xs: list[float], w: int = 5) -> list[float]:
    return [sum(xs[max(0, i - w + 1):i + 1]) / len(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]


def _figures(name: str, arms: dict[str, list[dict]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    panels = [
        ("curves", [("reward_mean", "training reward (5-step mean)", True), ("heldout_accuracy", "held-out pass@1", False)]),
        ("traces", [("ess", "normalized ESS of π/μ", True), ("kl_behavior", "KL(μ‖π) estimate", True)]),
    ]
    for tag, keys in panels:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.0), dpi=80)
        for ax, (key, label, smooth) in zip(axes, keys):
            for i, (arm, runs) in enumerate(arms.items()):
                steps, mean, se = _series(runs, key)
                if not steps:
                    continue
                if smooth:
                    mean, se = _smooth(mean), _smooth(se)
                c = COLORS[i % len(COLORS)]
                ax.plot(steps, mean, color=c, label=arm, lw=1.4, marker=None if smooth else "o", ms=3)
                ax.fill_between(steps, [m - s for m, s in zip(mean, se)], [m + s for m, s in zip(mean, se)], color=c, alpha=0.2)
            ax.set_xlabel("rollout round")
            ax.set_title(label, fontsize=9)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{name}: mean ± s.e. over seeds", fontsize=9)
        fig.tight_layout()
        f = f"{name}_{tag}.png"
        fig.savefig(out / f)
        plt.close(fig)
        files.append(f)
    # token log-ratio histograms at the first and the last recorded round, summed over seeds
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.0), dpi=80)
    for ax, pick, title in ((axes[0], min, "first round"), (axes[1], max, "last round")):
        for i, (arm, runs) in enumerate(arms.items()):
            recs = [r for run in runs for r in run["ratios"]]
            if not recs:
                continue
            step = pick(r["step"] for r in recs)
            chosen = [r for r in recs if r["step"] == step]
            counts = [sum(c) for c in zip(*(r["counts"] for r in chosen))]
            edges = chosen[0]["edges"]
            total = sum(counts) or 1
            ax.step(edges[:-1], [c / total for c in counts], where="post", color=COLORS[i % len(COLORS)], label=arm, lw=1.2)
        ax.set_yscale("log")
        ax.set_xlabel("log π_θ/μ per token (clamped to ±2)")
        ax.set_title(f"ratio histogram, {title}", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    f = f"{name}_ratios.png"
    fig.savefig(out / f)
    plt.close(fig)
    files.append(f)
    return files


def _final(runs: list[dict], key: str) -> tuple[float, float]:
    vals = []
    for run in runs:
        evals = [r for r in run["metrics"] if key in r and r["step"] > 0]
        if evals:
            vals.append(evals[-1][key])
    return _mean_se(vals)


def _over_steps(runs: list[dict], key: str) -> float:
    return _mean_se([sum(v) / len(v) for run in runs
                     if (v := [r[key] for r in run["metrics"] if key in r and r["step"] > 0])])[0]


def _pairs(arms: list[str]) -> list[tuple[str, str]]:
    """(reference, other) comparisons: p3o_X vs grpo_X by shared suffix, else every arm vs the first."""
    pairs = []
    for a in arms:
        if a.startswith("p3o_") or a == "p3o":
            suffix = a[len("p3o"):]
            pairs += [(a, b) for b in arms if b != a and not b.startswith("p3o") and b.endswith(suffix) and suffix]
    if pairs:
        return pairs
    return [(arms[0], b) for b in arms[1:]]


def _verdict(ref: str, other: str, a: tuple[float, float], b: tuple[float, float]) -> str:
    d = a[0] - b[0]
    se = math.sqrt((a[1] if math.isfinite(a[1]) else 0) ** 2 + (b[1] if math.isfinite(b[1]) else 0) ** 2)
    if se > 0 and abs(d) < 2 * se:
        return f"{ref} vs {other}: {a[0]:.3f} vs {b[0]:.3f} (difference {d:+.3f} ± {se:.3f}): no separation."
    better = ref if d > 0 else other
    return f"{ref} vs {other}: {a[0]:.3f} vs {b[0]:.3f} (difference {d:+.3f} ± {se:.3f}): **{better}** is ahead by more than 2 s.e."


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def experiment_section(name: str, exp_dir: Path, out: Path) -> tuple[str, list[str]]:
    """Markdown for one experiment and its one-line findings."""
    arms = load_runs(exp_dir)
    if not arms:
        return f"## {name}\n\nNo finished runs in `{exp_dir}`.\n", []
    spec = yaml.safe_load((exp_dir / "experiment.yaml").read_text()) if (exp_dir / "experiment.yaml").exists() else {}
    figs = _figures(name, arms, out)
    pk = sorted({k for runs in arms.values() for run in runs for r in run["metrics"] for k in r if k.startswith("heldout_pass@")})
    pk = pk[0] if pk else None
    lines = [f"## {name}", "", spec.get("description", ""), ""]
    if spec.get("command"):
        lines += [f"Ran `{spec['command']}` at commit `{spec.get('commit', 'unknown')}`.", ""]
    wall = [run["summary"]["wall_s"] for runs in arms.values() for run in runs]
    seeds = sorted({run["seed"] for runs in arms.values() for run in runs})
    lines.append(f"Seeds {seeds}; {len(wall)} runs of {wall and max(len(r['metrics']) - 1 for runs in arms.values() for r in runs)} rounds; "
                 f"one run took {min(wall) / 60:.1f}–{max(wall) / 60:.1f} min on one CPU thread"
                 + (f"; the whole experiment took {float((exp_dir / 'wall_s.txt').read_text()) / 60:.1f} min wall-clock." if (exp_dir / "wall_s.txt").exists() else "."))
    lines += ["", f"| arm | base pass@1 | final pass@1 | final {pk.removeprefix('heldout_') if pk else 'pass@k'} | greedy | mean ESS | min ESS | mean KL(μ‖π) |",
              "|---|---|---|---|---|---|---|---|"]
    finals = {}
    for arm, runs in arms.items():
        base = _mean_se([run["metrics"][0].get("heldout_accuracy") for run in runs])
        p1 = finals[arm] = _final(runs, "heldout_accuracy")
        pkv = _final(runs, pk) if pk else (float("nan"), float("nan"))
        gr = _final(runs, "heldout_greedy_accuracy")
        min_ess = _mean_se([min(r["ess"] for r in run["metrics"] if "ess" in r) for run in runs])[0]
        lines.append(f"| {arm} | {base[0]:.3f} | {p1[0]:.3f} ± {p1[1]:.3f} | {pkv[0]:.3f} ± {pkv[1]:.3f} | {gr[0]:.3f} ± {gr[1]:.3f} "
                     f"| {_over_steps(runs, 'ess'):.4f} | {min_ess:.4f} | {_over_steps(runs, 'kl_behavior'):.2e} |")
    lines += ["", "± is one standard error over seeds. pass@1 is the mean reward of the held-out samples at T = 1; greedy is one argmax completion per prompt.", ""]
    findings = [_verdict(a, b, finals[a], finals[b]) for a, b in _pairs(list(arms))]
    lines += ["**Findings (final held-out pass@1):**", ""] + [f"- {f}" for f in findings] + [""]
    lines += [f"![{f}]({f})" for f in figs] + [""]
    return "\n".join(lines), [f"{name}: {f}" for f in findings]


def write_report(runs: Path, out: Path, experiments: list[str] | None = None) -> Path:
    """Write ``out/README.md`` and the figures for ``experiments`` (default: every experiment under ``runs``).

    Raises:
        UserError: ``runs`` holds no experiment.
    """
    if not runs.is_dir():
        raise UserError(f"no lab runs in {str(runs)!r}; run `trustbatch lab run EXPERIMENT --out {runs}` first")
    names = experiments or sorted(p.name for p in runs.iterdir() if (p / "experiment.yaml").exists())
    if not names:
        raise UserError(f"no experiments under {str(runs)!r}")
    out.mkdir(parents=True, exist_ok=True)
    sections, findings = [], []
    for n in names:
        if not (runs / n).is_dir():
            raise UserError(f"experiment {n!r} has no runs in {str(runs)!r}")
        text, f = experiment_section(n, runs / n, out)
        sections.append(text)
        findings += f
    head = [
        "# Off-policy lab report", "",
        f"Generated {datetime.now():%Y-%m-%d %H:%M} from `{runs}` at commit `{git_commit()}` by "
        f"`trustbatch lab report --runs {runs} --out {out}`.", "",
        "Every run is `trustbatch train` on the default task (reasoning-gym chain_sum) and the default SFT base, "
        "with the lab's common settings (see `LAB_COMMON` in `src/trustbatch/lab/experiment.py`: 30 rounds × 32 prompts × 8 samples, held-out pass@1 from 256 prompts × 2 samples). "
        "Only the behaviour shift and the objective change between arms; nothing was tuned for any arm.", "",
        "## All findings", "",
        f"{len(findings)} comparisons of final held-out pass@1, each called only beyond two standard errors. With 3 "
        "seeds per arm the standard errors are themselves noisy: the two-s.e. rule is roughly a t-test with 4 degrees "
        f"of freedom at p ≈ 0.12, so about {0.12 * len(findings):.1f} of these verdicts would be called by chance "
        "alone. Read single verdicts with that in mind.", "",
        *[f"- {f}" for f in findings], "",
    ]
    path = out / "README.md"
    atomic_write(path, "\n".join(head + sections) + "\n")
    return path
