"""The off-policy lab: experiments (arms × seeds of ``trustbatch train``), a parallel resumable runner, a report.

The lab is an extra (``pip install 'trustbatch[lab]'``): what it needs beyond the core install is imported where it
is used, so ``trustbatch.lab`` imports without it, and ``require_lab_extra`` turns its absence into one line.
"""

from importlib.util import find_spec

from ..errors import UserError
from .experiment import Experiment, load_experiment
from .runner import run_experiment

# what `trustbatch[lab]` brings (scipy: the t quantiles of lab.stats), and matplotlib (core: a training run's
# plot.png) for the report's figures, should an environment lack it
LAB_MODULES = ("scipy", "matplotlib")


def require_lab_extra() -> None:
    """Check that the lab's dependencies (``LAB_MODULES``) are installed, without importing them.

    Raises:
        UserError: one is missing; the fix is the ``lab`` extra.
    """
    missing = [m for m in LAB_MODULES if find_spec(m) is None]
    if missing:
        raise UserError(f"the lab needs the lab extra: pip install 'trustbatch[lab]' ({', '.join(missing)} not installed)")


__all__ = ["Experiment", "load_experiment", "require_lab_extra", "run_experiment"]
