"""An experiment: named arms (config overrides) × seeds, on top of the lab's common settings.

YAML form (see examples/lab/)::

    description: one line on what the experiment asks
    common: {rollout.temperature: 1.2}        # applied to every arm (dotted keys)
    seeds: [0, 1, 2]
    arms:
      p3o: {objective.name: p3o}
      grpo: {objective.name: grpo}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..config import load_config, read_yaml_file
from ..errors import UserError

# Small enough that one run takes one to two minutes on one core (so an experiment of 4 arms × 3
# seeds fits in 30 minutes on 2 cores); the task and base model are the defaults, so the cached
# base of `make run` is reused. Held-out: the 256 default prompts × 2 samples, at rounds 0, 15, 30.
LAB_COMMON: dict = {
    "train.steps": 30,
    "rollout.prompts_per_step": 32,
    "eval.every": 15,
    "eval.samples_per_prompt": 2,
    "checkpoint_every": 15,
    "threads": 1,
}
EXPERIMENTS_DIR = Path(__file__).resolve().parents[3] / "examples" / "lab"


@dataclass
class Experiment:
    name: str
    description: str
    seeds: list[int]
    arms: dict[str, dict]  # arm name -> dotted overrides (common settings already merged)
    source: Path | None = None
    notes: list[str] = field(default_factory=list)

    def overrides(self, arm: str, seed: int) -> list[str]:
        """``key=value`` overrides for one run (values as YAML flow text)."""
        merged = {**self.arms[arm], "train.seed": seed}
        return [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                for k, v in merged.items()]


def resolve_experiment(name_or_path: str) -> Path:
    """A YAML path, or the name of one of the bundled experiments under examples/lab/."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    q = EXPERIMENTS_DIR / f"{name_or_path}.yaml"
    if q.is_file():
        return q
    known = sorted(x.stem for x in EXPERIMENTS_DIR.glob("*.yaml")) if EXPERIMENTS_DIR.is_dir() else []
    raise UserError(f"no experiment {name_or_path!r}: give a YAML file or one of {', '.join(known) or '(none found)'}")


def load_experiment(name_or_path: str, seeds: list[int] | None = None) -> Experiment:
    """Load and validate an experiment: every arm's config must load (unknown keys fail here, before any run).

    Raises:
        UserError: a missing file, a malformed experiment or an invalid arm config.
    """
    path = resolve_experiment(name_or_path)
    spec = read_yaml_file(path, what="experiment") or {}
    if not isinstance(spec, dict) or not isinstance(spec.get("arms"), dict) or not spec["arms"]:
        raise UserError(f"experiment {str(path)!r} needs an 'arms' mapping of arm name -> overrides")
    common = {**LAB_COMMON, **(spec.get("common") or {})}
    arms = {str(a): {**common, **(o or {})} for a, o in spec["arms"].items()}
    exp = Experiment(name=path.stem, description=str(spec.get("description", "")),
                     seeds=list(seeds or spec.get("seeds") or [0, 1, 2]), arms=arms, source=path)
    for arm in arms:
        try:
            load_config(None, exp.overrides(arm, exp.seeds[0]))
        except UserError as e:
            raise UserError(f"experiment {path.stem!r}, arm {arm!r}: {e}") from None
    return exp
