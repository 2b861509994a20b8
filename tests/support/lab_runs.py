"""Finished lab runs written by hand, for report tests: the files ``lab report`` reads, with chosen scores."""

import json
from pathlib import Path


def write_runs(exp: Path, finals: dict[str, list[float]]) -> None:
    """Runs of 4 rounds under ``exp/ARM/seedK`` whose held-out pass@1 at rounds 2 and 4 is ``finals[arm][seed]``
    (the primary score); round 0 (the base) is 0.3."""
    for arm, per_seed in finals.items():
        for seed, final in enumerate(per_seed):
            d = exp / arm / f"seed{seed}"
            d.mkdir(parents=True)
            rows = [{"step": 0, "heldout_accuracy": 0.3}] + [{"step": s, "reward_mean": 0.5} for s in range(1, 5)]
            rows[2]["heldout_accuracy"] = rows[4]["heldout_accuracy"] = final
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (d / "summary.json").write_text(json.dumps({"steps": 4, "wall_s": 60.0}))
