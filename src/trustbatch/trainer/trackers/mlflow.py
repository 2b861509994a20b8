"""MLflow: a run named after the run directory in experiment ``MLFLOW_EXPERIMENT_NAME`` (default ``trustbatch``).

The tracking store is ``log.mlflow_uri``, else ``MLFLOW_TRACKING_URI``, else ``default_store``: ``mlflow.db`` in the
folder that holds the run directory (``runs/mlflow.db`` for the default ``run_dir``), not MLflow's own default in the
working directory; an experiment created there keeps its artifacts in ``mlruns/`` beside it. A resumed run sets the
stored run back to RUNNING and appends to it. MLflow cannot delete a metric: when the stored run may hold rounds the
resume redoes (it was sent rounds past the checkpoint resumed from), the resume continues in a new run instead, with
the same name, parameters and tags, sent every round of ``metrics.jsonl`` once, and deletes the old one (MLflow keeps
a deleted run until ``mlflow gc``: ``MlflowClient.restore_run`` brings it back).
"""

from __future__ import annotations

import os
import re
import time
import warnings
from pathlib import Path

MAX_PARAM = 6000  # MLflow's longest parameter value (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH)
BATCH = 100  # MLflow's most parameters in one log_batch call
MAX_METRICS = 1000  # MLflow's most metrics in one log_batch call (mlflow.utils.validation.MAX_METRICS_PER_BATCH)


def check_store(uri: str | None, run_dir: Path | None = None) -> None:
    """Open the tracking store ``uri`` (None: ``MLFLOW_TRACKING_URI``, else ``default_store(run_dir)`` beside the run
    directory, its folder made) as ``start`` will, before any model loads: a SQL store is created there (its tables
    too), so an unwritable one fails here. (It opened MLflow's own default instead, ./mlflow.db: a file in the
    working directory, and the run's store unchecked.)

    Raises:
        UserError: MLflow refuses the URI (an unknown scheme) or cannot open the store (a path that cannot be
            created or written); the message names the URI and MLflow's reason.
    """
    import mlflow
    from mlflow.tracking import MlflowClient

    from ...errors import UserError

    store = uri or os.environ.get("MLFLOW_TRACKING_URI")
    try:
        if store is None and run_dir is not None:
            Path(run_dir).resolve().parent.mkdir(parents=True, exist_ok=True)
            store = default_store(Path(run_dir))[0]
        MlflowClient(tracking_uri=store)  # resolves the store now (MLflow checks the URI on construction)
    except Exception as e:  # noqa: BLE001 - MLflow raises its own types, SQLAlchemy's and OSError alike
        named = store or mlflow.get_tracking_uri()
        where = f"log.mlflow_uri={uri!r}" if uri else (f"the MLflow tracking store {named!r} (MLFLOW_TRACKING_URI, "
                                                       "else mlflow.db beside the run directory)")
        cause = " ".join(str(e).split())
        cause = cause if len(cause) <= 200 else cause[:199] + "…"
        raise UserError(f"{where} cannot be used ({type(e).__name__}: {cause}); give a store MLflow can write, e.g. "
                        "log.mlflow_uri=sqlite:///PATH/mlflow.db in a folder you can write, or http://HOST:5000") from None


class MlflowTracker:
    """An MLflow run through ``MlflowClient`` (no fluent active-run state in the trainer's process)."""

    name = "mlflow"
    durable = True  # log_batch returns once the store holds the metrics (synchronous=True)

    def __init__(self, uri: str | None = None):
        self.uri, self.client, self.run_id = uri, None, None
        self._artifacts: str | None = None  # the artifact location of an experiment this tracker creates

    def start(self, config: dict, run_dir: Path, resume_id: str | None, held: dict) -> str:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = self.uri or os.environ.get("MLFLOW_TRACKING_URI")
        self._artifacts = None if uri else default_store(Path(run_dir))[1]
        self.client = MlflowClient(tracking_uri=uri or default_store(Path(run_dir))[0])
        old = None
        if resume_id is not None:
            try:
                old = self.client.get_run(resume_id)
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                warnings.warn(f"MLflow run {resume_id} (RUN_DIR/trackers.json) is not in the tracking store "
                              f"{self.client.tracking_uri}; the run goes on in a new run, sent every round of "
                              "metrics.jsonl", stacklevel=2)
        if old is not None and not held.get("stale"):
            self.client.update_run(resume_id, status="RUNNING")
            self.run_id = resume_id
        else:  # a new run, or one that replaces a run holding redone rounds: sent every round from the first
            self.run_id = self._create(Path(run_dir), config, replaces=old)
            held.update(through=-1, stale=False)
        # parameters cannot change once logged; the config artifact holds a resume's latest values
        self.client.log_dict(self.run_id, config, "config.json")
        return self.run_id

    def _create(self, run_dir: Path, config: dict, replaces=None) -> str:
        """A new run named after ``run_dir`` with ``config`` as parameters; ``replaces``: the stored run it takes the
        place of (its experiment, parameters and tags are kept, and it is deleted)."""
        from mlflow.entities import Param

        tags = {"trustbatch.run_dir": str(run_dir.resolve())}
        if replaces is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "trustbatch")
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                name, artifact_location=self._artifacts)
            params = [Param(k, str(v)[:MAX_PARAM]) for k, v in flat_config(config).items()]
        else:
            experiment_id = replaces.info.experiment_id
            params = [Param(k, v) for k, v in replaces.data.params.items()]
            tags = {**{k: v for k, v in replaces.data.tags.items() if not k.startswith("mlflow.")}, **tags,
                    "trustbatch.replaces": replaces.info.run_id}
        run = self.client.create_run(experiment_id, run_name=run_dir.name, tags=tags)
        for i in range(0, len(params), BATCH):
            self.client.log_batch(run.info.run_id, params=params[i:i + BATCH], synchronous=True)
        if replaces is not None and replaces.info.lifecycle_stage != "deleted":
            self.client.set_terminated(replaces.info.run_id, status="KILLED")
            self.client.delete_run(replaces.info.run_id)
        return run.info.run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.log_rounds([(step, metrics)])

    def log_rounds(self, rounds: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for step, m in rounds for k, v in m.items()]
        for i in range(0, len(metrics), MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS], synchronous=True)

    def log_samples(self, rows: list[dict], round_: int, split: str) -> None:
        self.client.log_dict(self.run_id, rows, samples_artifact(round_, split))

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def default_store(run_dir: Path) -> tuple[str, str]:
    """``(tracking URI, artifact location URI)`` when neither ``log.mlflow_uri`` nor ``MLFLOW_TRACKING_URI`` names a
    store: ``sqlite:////abs/runs/mlflow.db`` and ``file:///abs/runs/mlruns``, beside the run directory, so that the
    store and the runs are in one folder (git-ignored) and not scattered in each working directory."""
    folder = Path(run_dir).resolve().parent
    return f"sqlite:///{folder / 'mlflow.db'}", (folder / "mlruns").as_uri()


def samples_artifact(round_: int, split: str) -> str:
    """The artifact path of a round's sample completions: ``samples/train/round_000010.json`` (a list of
    ``samples.jsonl``'s lines; a resume that sends a round again overwrites it)."""
    return f"samples/{split}/round_{round_:06d}.json"


def flat_config(config: dict, prefix: str = "") -> dict[str, object]:
    """Nested config sections as dotted keys (``train.lr``): MLflow's parameters are flat."""
    out: dict[str, object] = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts (letters, digits, ``_ - . / :`` and space): ``pass@k`` becomes ``pass_at_k``."""
    return re.sub(r"[^\w./\- :]", "_", key.replace("@", "_at_"))
