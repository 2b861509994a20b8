"""An experiment: named arms (config overrides) × seeds, on top of the lab's common settings.

YAML form (the bundled experiments: ``trustbatch/lab/experiments/*.yaml``, package data)::

    description: one line on what the experiment asks
    common: {rollout.temperature: 1.2}        # applied to every arm (dotted keys)
    seeds: [0, 1, 2, 3, 4, 5]                 # default LAB_SEEDS
    per_seed_base: true                       # model.seed = seed: each seed has its own SFT base (default)
    arms:
      onpolicy: {}                            # the reference: no shift
      p3o@T0.6: {objective.name: p3o, rollout.temperature: 0.6}
      grpo_eps0.2@T0.6: {objective.name: grpo, objective.options: {clip_eps: 0.2}, rollout.temperature: 0.6}
    compare: [[p3o@T0.6, grpo_eps0.2@T0.6]]  # optional; default: p3o* arms vs the other arms of the same dose
    preflight_only: [grpo_eps0.2@T0.6]        # optional: probed by ``lab preflight``, not run by ``lab run``
    tune: {arms: [grpo_eps0.2@T0.6, grpo_eps0.4@T0.6], seeds: [6, 7, 8]}
                                              # optional: a grid whose best arm (on its own seeds) is the
                                              # tuned baseline; see ``trustbatch.lab.stats.pick_tuned``
    registered: c168f4f                       # optional: the commit that registered the design before any
                                              # run; the report checks every run's commit descends from it
    equivalence_margin: 0.05                  # optional: the TOST margin (default stats.MARGIN, 0.02)
    wilcoxon: true                            # optional: a signed-rank test beside each paired interval
    interaction: [[p3o@T1.2, grpo@T1.2], [p3o@T1.0, grpo@T1.0]]
                                              # optional: one difference of differences (stats.interaction)

An arm is named ``family@dose``: the family is the objective setting (compared across doses), the
dose the strength of the shift (in the order the arms list them). An arm without ``@`` has no dose.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path


from ..config import _flatten, load_config, read_yaml_file, yaml_dumps
from ..errors import UserError

# Lab II (issue 14): long enough to learn and to collapse, with one optimizer step per rollout round
# (the paper's recipe; replay overrides it), held-out pass@1 from the 256 default prompts × 8 samples
# at five points (rounds 0, 25, 50, 75, 100), and 6 seeds each with its own SFT base (``model.seed``
# follows the seed). 64 prompts per round, not 32: at 32 the on-policy reference neither gained nor
# collapsed in 100 rounds at lr 3e-4 and lost ground at 1e-3 (experiments/collapse_check.yaml); at 64
# and 3e-4 it gains (experiments/calibrate_batch.yaml). A run takes about 2.2 min on one thread.
LAB_COMMON: dict = {
    "train.steps": 100,
    "rollout.prompts_per_step": 64,
    "eval.every": 25,
    "eval.samples_per_prompt": 8,
    "checkpoint_every": 25,
    "threads": 1,
    "train.diagnostics": True,  # the report's GRPO clip share (grpo_zeroed_*) on every arm's own data
}
LAB_SEEDS = [0, 1, 2, 3, 4, 5]


@dataclass
class Experiment:
    name: str
    description: str
    seeds: list[int]
    arms: dict[str, dict]  # arm name -> dotted overrides (common settings already merged)
    source: Path | None = None
    notes: list[str] = field(default_factory=list)
    per_seed_base: bool = True
    compare: list[tuple[str, str]] = field(default_factory=list)
    preflight_only: list[str] = field(default_factory=list)
    tune_arms: list[str] = field(default_factory=list)  # the grid a tuned baseline is picked from
    tune_seeds: list[int] = field(default_factory=list)  # the seeds it is picked on, disjoint from ``seeds``
    registered: str | None = None  # the commit that registered the design before any run (a confirmatory experiment)
    selected: list[str] | None = None  # ``lab run --arms``: train only these arms; the folder still lists every arm
    analysis: dict = field(default_factory=dict)  # the report's analysis keys (``ANALYSIS_KEYS``) as the YAML gives them

    @property
    def run_arms(self) -> list[str]:
        """The arms ``lab run`` trains: every arm but the pre-flight-only ones (doses the pre-flight measured
        and the full run leaves out, to fit its time budget or because the pre-flight found a control)."""
        return [a for a in self.arms if a not in self.preflight_only]

    @property
    def runs(self) -> list[tuple[str, int]]:
        """Every (arm, seed) ``lab run`` trains: the run arms on the experiment's seeds, then the tuning grid on
        its own seeds (picked there, compared on ``seeds``, so the pick never sees the seeds it is judged on)."""
        runs = [(a, s) for a in self.run_arms for s in self.seeds] + [(a, s) for a in self.tune_arms for s in self.tune_seeds]
        return runs if self.selected is None else [(a, s) for a, s in runs if a in self.selected]

    def select(self, arms: list[str]) -> "Experiment":
        """This experiment with ``lab run`` limited to ``arms`` (a follow-up arm, or one dose before another).

        Comparisons, reports and the folder's ``experiment.yaml`` still cover every arm. A tuning-grid arm
        selected here also runs on its tuning seeds.

        Raises:
            UserError: an arm the experiment does not have, a pre-flight-only arm, or no arm at all.
        """
        if not arms:
            raise UserError(f"--arms names no arm; give some of {', '.join(self.run_arms)}")
        for a in arms:
            if a not in self.arms:
                raise UserError(f"experiment {self.name!r} has no arm {a!r}; its run arms are {', '.join(self.run_arms)}")
            if a in self.preflight_only:
                raise UserError(f"arm {a!r} of {self.name!r} is pre-flight only (`lab preflight` probes it); "
                                f"move it out of preflight_only to train it")
        return replace(self, selected=list(dict.fromkeys(arms)))

    def overrides(self, arm: str, seed: int) -> list[str]:
        """``key=value`` overrides for one run (values as YAML flow text)."""
        merged = {**self.arms[arm], "train.seed": seed}
        if self.per_seed_base:
            merged["model.seed"] = seed
        return [f"{k}={yaml_dumps(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                for k, v in merged.items()]


def bundled_experiments() -> dict[str, Traversable]:
    """{name: file} of the experiments shipped with the package (``trustbatch/lab/experiments/*.yaml``, read
    through ``importlib.resources``, so an installed wheel has them as a checkout does)."""
    folder = resources.files(__package__).joinpath("experiments")
    return {f.name.removesuffix(".yaml"): f for f in folder.iterdir() if f.name.endswith(".yaml")}


def resolve_experiment(name_or_path: str) -> Path | Traversable:
    """A YAML path, or the name of one of the bundled experiments (``bundled_experiments``).

    Raises:
        UserError: neither a file nor a bundled experiment's name (names the bundled ones).
    """
    p = Path(name_or_path)
    if p.is_file():
        return p
    bundled = bundled_experiments()
    if name_or_path in bundled:
        return bundled[name_or_path]
    raise UserError(f"no experiment {name_or_path!r}: give a YAML file or one of {', '.join(sorted(bundled)) or '(none found)'}")


def load_experiment(name_or_path: str, seeds: list[int] | None = None) -> Experiment:
    """Load and validate an experiment: every arm's config must load (unknown keys fail here, before any run).

    Raises:
        UserError: a missing file, a malformed experiment or an invalid arm config.
    """
    # a bundled experiment is a plain file in an installed package; as_file copies it out only from a zip
    with resources.as_file(resolve_experiment(name_or_path)) as path:
        spec = read_yaml_file(path, what="experiment") or {}
    if not isinstance(spec, dict) or not isinstance(spec.get("arms"), dict) or not spec["arms"]:
        raise UserError(f"experiment {str(path)!r} needs an 'arms' mapping of arm name -> overrides")
    # dotted keys, as a config file's sections are read: a nested section ({rollout: {precision: ...}}) set whole
    # would replace LAB_COMMON's and common's keys of that section (T = 1.0 where common said 0.6, 250 rounds)
    common = {**LAB_COMMON, **_flatten(dict(spec.get("common") or {}))}
    arms = {str(a): {**common, **_flatten(dict(o or {}))} for a, o in spec["arms"].items()}
    if bad := next((a for a in arms if "/" in a or "\\" in a or a.startswith(".") or not a.strip()), None):
        raise UserError(f"experiment {str(path)!r}: arm name {bad!r} would not be one folder (it names the arm's "
                        "folder of runs); use letters, digits, '@', '_', '-' and '.' inside the name")
    compare = spec.get("compare") or []
    if not isinstance(compare, list) or any(not isinstance(c, list) or len(c) != 2 or any(x not in arms for x in c)
                                            for c in compare):
        raise UserError(f"experiment {str(path)!r}: 'compare' must be a list of [arm, arm] pairs naming arms of the experiment")
    only = spec.get("preflight_only") or []
    if not isinstance(only, list) or any(a not in arms for a in only):
        raise UserError(f"experiment {str(path)!r}: 'preflight_only' must be a list naming arms of the experiment")
    if probed := [c for c in compare if set(c) & set(only)]:
        raise UserError(f"experiment {str(path)!r}: 'compare' pair {probed[0]} names a preflight_only arm, which "
                        "never trains; drop the pair or move the arm out of preflight_only")
    _check_analysis(spec, arms, str(path))
    main_seeds = list(seeds or spec.get("seeds") or LAB_SEEDS)
    if len(set(main_seeds)) != len(main_seeds):
        raise UserError(f"experiment {str(path)!r}: seeds {main_seeds} repeat a seed; give each seed once")
    t_arms, t_seeds = _tune(spec.get("tune"), arms, only, main_seeds, str(path))
    exp = Experiment(name=path.stem, description=str(spec.get("description", "")),
                     seeds=main_seeds, arms=arms, source=path,
                     per_seed_base=bool(spec.get("per_seed_base", True)), compare=[tuple(c) for c in compare],
                     preflight_only=[str(a) for a in only], tune_arms=t_arms, tune_seeds=t_seeds,
                     registered=str(spec["registered"]) if spec.get("registered") else None,
                     analysis={k: spec[k] for k in ANALYSIS_KEYS if k in spec})
    for arm in arms:
        try:
            load_config(None, exp.overrides(arm, exp.seeds[0]))
        except UserError as e:
            raise UserError(f"experiment {path.stem!r}, arm {arm!r}: {e}") from None
    return exp


# keys the report's analysis reads; ``lab run`` writes them into the folder's experiment.yaml with the design
ANALYSIS_KEYS = ("equivalence_margin", "wilcoxon", "interaction")


def _check_analysis(spec: dict, arms: dict, where: str) -> None:
    """Check the optional analysis keys (``equivalence_margin``, ``wilcoxon``, ``interaction``) the report reads.

    Raises:
        UserError: a margin that is not a positive number, a non-boolean ``wilcoxon``, or an ``interaction`` that is
            not two [arm, arm] pairs of the experiment's arms.
    """
    margin = spec.get("equivalence_margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin > 0):
        raise UserError(f"experiment {where!r}: 'equivalence_margin' must be a positive number, got {margin!r}")
    if not isinstance(spec.get("wilcoxon", False), bool):
        raise UserError(f"experiment {where!r}: 'wilcoxon' must be true or false, got {spec['wilcoxon']!r}")
    inter = spec.get("interaction")
    if inter is not None and (not isinstance(inter, list) or len(inter) != 2 or any(
            not isinstance(p, list) or len(p) != 2 or any(x not in arms for x in p) for p in inter)):
        raise UserError(f"experiment {where!r}: 'interaction' must be [[A1, B1], [A2, B2]] naming arms of the "
                        f"experiment, got {inter!r}")


def _tune(tune, arms: dict, only: list, main_seeds: list[int], where: str) -> tuple[list, list]:
    """(grid arms, tuning seeds) of an experiment's ``tune`` mapping, checked; ([], []) without one."""
    if not tune:
        return [], []
    form = "'tune' must be {arms: [arm, ...], seeds: [int, ...]}"
    if not isinstance(tune, dict) or not isinstance(tune.get("arms"), list) or not isinstance(tune.get("seeds"), list):
        raise UserError(f"experiment {where!r}: {form}")
    t_arms, t_seeds = tune["arms"], tune["seeds"]
    bad = [a for a in t_arms if a not in arms or a in only]
    if not t_arms or bad:
        raise UserError(f"experiment {where!r}: {form}; its arms must be run arms of the experiment "
                        f"({', '.join(map(str, bad)) or 'none given'})")
    if not t_seeds or any(not isinstance(x, int) or isinstance(x, bool) for x in t_seeds) or len(set(t_seeds)) != len(t_seeds):
        raise UserError(f"experiment {where!r}: {form}; its seeds must be distinct integers, got {t_seeds}")
    if len(set(t_arms)) != len(t_arms):
        raise UserError(f"experiment {where!r}: 'tune' lists an arm twice in {t_arms}")
    both = sorted(set(t_seeds) & set(main_seeds))
    if both:
        raise UserError(f"experiment {where!r}: tuning seeds {both} are also comparison seeds; a tuned baseline "
                        "must be picked on seeds it is not judged on")
    return [str(a) for a in t_arms], list(t_seeds)


def family_and_dose(arm: str) -> tuple[str, str | None]:
    """``"grpo_eps0.2@int8"`` → ("grpo_eps0.2", "int8"); an arm without ``@`` has no dose."""
    fam, _, dose = arm.partition("@")
    return fam, (dose or None)


def default_comparisons(arms: list[str]) -> list[tuple[str, str]]:
    """Each ``p3o*`` arm against every other non-reference arm of the same dose (the reference,
    ``onpolicy``, is a baseline for the dose–response plot, not a contestant)."""
    pairs = []
    for a in arms:
        fa, da = family_and_dose(a)
        if not fa.startswith("p3o"):
            continue
        pairs += [(a, b) for b in arms if b != a and family_and_dose(b)[1] == da
                  and not family_and_dose(b)[0].startswith("p3o") and family_and_dose(b)[0] != "onpolicy"]
    return pairs
