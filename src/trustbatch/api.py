"""The Python API: ``Trainer(...).train()`` runs the same ``trustbatch train`` as the command line, with Python objects.

TRL users write ``GRPOTrainer(model=..., reward_funcs=[f, g], reward_weights=[...], train_dataset=ds)``; here::

    from trustbatch.api import Trainer

    summary = Trainer(model="Qwen2.5-0.5B-Instruct/", reward_funcs=[correct, short], reward_weights=[1.0, 0.2],
                      train_dataset=rows, overrides={"train.steps": 100}).train()

Everything becomes a ``Config`` first (what ``--print-config`` shows and ``config.yaml`` keeps), and the run is
``recipes.train.train``: one build path, no second trainer. Datasets are written once to the cache as JSONL, named by
their content's hash, and the config points at that file, so the run directory's config names data that stays.
Reward functions become ``reward.functions`` terms by name (``rewards.objects.reward_name``): an importable
module-level function runs as ``module:function`` everywhere; any other callable is scored in this process.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePath
from typing import Any, Callable, Iterable, Mapping, Sequence

from pydantic import BaseModel

from .config import Config, _flatten, load_config
from .data.benchmarks import first_row
from .errors import UserError
from .policy.base import cache_dir
from .records import atomic_write
from .rewards.scorers import is_score
from .recipes.train import saved_config, train
from .rewards.objects import in_other_processes, register_again, reward_name


class Trainer:
    """RL post-training from Python; ``train()`` returns the run's summary (also written to ``summary.json``).

    Args:
        config: a ``Config``, a dict (nested as a YAML file holds it, or with dotted keys), a YAML file's path, or
            None for the defaults.
        model: a local model directory (``model.path``).
        reward_funcs: a reward function or a list of them, each a scorer name (``"gsm8k"``, ``"module:function"``) or a callable:
            ``f(completion, reference) -> float`` per completion, or TRL's batch form
            ``f(prompts, completions, reference, **columns) -> list`` (the batch form is called once per group, the
            completions of one prompt together, so it may rank them).
        reward_weights: one weight per reward function (default 1 each); the training reward is Σ w_i r_i. A reward
            model (TRL's model-id reward_funcs) is ``overrides={"reward.model": DIR}``, one more term of that sum.
        train_dataset, eval_dataset: rows as a list of dicts, a ``datasets.Dataset``, a pandas ``DataFrame`` or a
            file path, in any format ``data.train`` reads (GSM8K, MATH, Countdown, or ``prompt``/``answer`` fields).
            Rows with TRL's ``prompt`` column are framed as TRL frames them (``data.chat_template=messages``: a text
            prompt as it is, a prompt given as chat messages through the chat template) unless the config or
            ``overrides`` set ``data.chat_template`` or ``data.system_prompt`` (``auto`` templates text prompts too,
            the command line's default).
        overrides: ``{"train.steps": 4}``, ``{"train": {"steps": 4}}`` or ``["train.steps=4"]``, applied last. A
            dict is read as a YAML file's mapping is: a dict value sets the keys inside it (``{"model.lora": {"r":
            8}}`` keeps the other LoRA keys set before), never the whole section as ``model.lora={r: 8}`` does on
            the command line; ``task.params``, ``objective.options`` and ``rollout.foreign_model`` are set whole.
        resume: a run directory to continue from its last checkpoint, as ``trustbatch train --resume``: its saved
            config, with ``overrides`` of the resumable keys only; give the same reward callables again.

    Raises:
        UserError: bad input, in one line (an unknown key, a weight count that differs from the functions', a
            callable reward with async rollout workers or Ray, which cannot reach it), and whatever ``train`` raises.
    """

    def __init__(self, config: Config | Mapping[str, Any] | str | Path | None = None, *, model: str | Path | None = None,
                 reward_funcs: Sequence[Callable | str] | None = None, reward_weights: Sequence[float] | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None,
                 overrides: Mapping[str, Any] | Sequence[str] | None = None, resume: str | Path | None = None):
        self.resume = str(resume) if resume is not None else None
        if reward_funcs is not None and (callable(reward_funcs) or isinstance(reward_funcs, str)
                                         or not isinstance(reward_funcs, Iterable)):
            reward_funcs = [reward_funcs]  # one function, as TRL's GRPOTrainer takes it (reward_name refuses a non-callable)
        if self.resume is not None:
            if any(x is not None for x in (config, model, train_dataset, eval_dataset, reward_weights)):
                raise UserError("resume continues a run with its saved config; give only reward_funcs (the same "
                                "callables as before) and overrides of the resumable keys")
            for f in reward_funcs or []:
                reward_name(f)  # refuses what is not callable
            register_again(list(reward_funcs or []), _saved_reward_names(Path(self.resume)))
            self.config, self._overrides = None, _override_list(overrides)
            return
        # only what was set: a dump of every field would read as all set, and drop the defaults that follow the data
        # (the answer budget, a task's parameters)
        base = _set_values(config) if isinstance(config, Config) else None
        path = None if isinstance(config, (Config, Mapping)) or config is None else str(config)
        # a dict is read as a YAML file's mapping would be, under what the keyword arguments set
        first = _override_list(config) if isinstance(config, Mapping) else []
        sets: dict[str, Any] = {}
        if model is not None:
            sets["model.path"] = str(model)
        if train_dataset is not None:
            sets["data.train"] = _as_file(train_dataset, "train_dataset")
        if eval_dataset is not None:
            sets["data.heldout"] = _as_file(eval_dataset, "eval_dataset")
        if reward_funcs:
            weights = _weights(reward_weights, len(reward_funcs))
            sets["reward.functions"] = [{"name": reward_name(f), "weight": w} for f, w in zip(reward_funcs, weights)]
        elif reward_weights is not None:
            raise UserError("reward_weights without reward_funcs; give the functions they weigh")
        args = first + [f"{k}={_value(v)}" for k, v in sets.items()] + _override_list(overrides)
        self.config = load_config(path, args, base=base)
        if train_dataset is not None and _trl_prompts(self.config):
            self.config = load_config(path, args + ["data.chat_template=messages"], base=base)
        names = [t.name for t in self.config.reward.functions]
        if self.config.rollout.mode == "async":
            in_other_processes(names, "rollout.mode=async (rollout worker processes)")
        if self.config.orchestrator == "ray":
            in_other_processes(names, "orchestrator=ray")

    def train(self) -> dict:
        """Run the training, or continue it (``resume``); returns the summary dict (``recipes.train.train``)."""
        if self.resume is not None:
            return train(None, resume=self.resume, overrides=self._overrides)
        return train(self.config)


def _trl_prompts(cfg: Config) -> bool:
    """Whether the training rows carry TRL's ``prompt`` column, read as TRL reads it, and nothing set the framing (nor
    a system prompt, which the template carries): then ``data.chat_template=messages`` (a text prompt as it is, chat
    messages through the template: TRL's rule)."""
    d = cfg.data
    if "chat_template" in d.model_fields_set or d.prompt_field is not None or d.system_prompt or not d.train:
        return False
    row = first_row(d.train, d.dir)
    return row is not None and "prompt" in row


def _saved_reward_names(run: Path) -> list[str]:
    """The reward function names of the run's saved config.

    Raises:
        UserError: the run directory or its config cannot be read (``recipes.train.saved_config``).
    """
    saved = saved_config(run)
    functions = (saved.get("reward") or {}).get("functions") or []
    return [t["name"] for t in functions if isinstance(t, dict) and isinstance(t.get("name"), str)]


def _override_list(overrides: Mapping[str, Any] | Sequence[str] | None) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        # {"reward": {"workers": 0}} is reward.workers=0, as in a YAML file: set whole, it would replace the section
        # and drop what reward_funcs, model or train_dataset set in it
        return [f"{k}={_value(v)}" for k, v in _flatten(dict(overrides)).items()]
    if isinstance(overrides, str):
        raise UserError(f"overrides={overrides!r} is one string; give a list of key=value strings or a dict")
    return [str(o) for o in overrides]


def _set_values(model: BaseModel) -> dict:
    """The values of ``model`` (a ``Config`` or a section) that were set, by construction or assignment, nested as
    ``model_dump(mode="json")`` gives them (pydantic's ``exclude_unset`` drops a section that was not set as a whole,
    with what was assigned inside it). A section set as a whole keeps its dump, if empty (``model.lora: {}``)."""
    full = model.model_dump(mode="json")
    out = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            inner = _set_values(value)
            if inner or name in model.model_fields_set:
                out[name] = inner
        elif name in model.model_fields_set:
            out[name] = full[name]
    return out


def _weights(reward_weights: Any, n: int) -> list[float]:
    """One float per reward function: ``reward_weights`` (a number for one function, or a list), default 1 each.

    Raises:
        UserError: a weight that is not a number, or a count that differs from ``n``.
    """
    if reward_weights is None:
        return [1.0] * n
    many = isinstance(reward_weights, Iterable) and not isinstance(reward_weights, str) and not is_score(reward_weights)
    weights = list(reward_weights) if many else [reward_weights]
    bad = next((w for w in weights if isinstance(w, bool) or not is_score(w)), None)
    if bad is not None:
        raise UserError(f"reward weight {bad!r} is a {type(bad).__name__}; give numbers, one per reward function")
    if len(weights) != n:
        raise UserError(f"{len(weights)} reward_weights for {n} reward_funcs; give one weight per function")
    return [float(w) for w in weights]


def _value(v: Any) -> str:
    """``v`` as an override's value (JSON, which YAML reads): a path as its text, a NumPy scalar as its number.

    Raises:
        UserError: a value JSON cannot write (an object, a set).
    """
    def plain(x):
        if isinstance(x, PurePath):
            return str(x)
        if hasattr(x, "item") and getattr(x, "ndim", None) == 0:
            return x.item()
        raise TypeError(type(x).__name__)
    try:
        return json.dumps(v, default=plain)
    except (TypeError, ValueError) as e:
        raise UserError(f"value {v!r} cannot be a config value (it holds a {e}); give numbers, strings, booleans, "
                        "paths, lists or dicts") from None


def _as_file(data: Any, what: str) -> str:
    """A path for ``data``: a path as it is; rows (a list of dicts, a ``datasets.Dataset``) written to the cache as
    JSONL named by the SHA-256 of their content, so the same rows always give the same file."""
    if isinstance(data, (str, Path)):
        return str(data)
    rows = _rows(data, what)
    text = "".join(json.dumps(r, sort_keys=True, default=_json_cell) + "\n" for r in rows)
    path = cache_dir() / "datasets" / f"{what}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.jsonl"
    if not path.exists():
        atomic_write(path, text)
    return str(path)


def _json_cell(x: Any) -> Any:
    """A cell JSON does not take, as the value it holds: a NumPy array (a pandas DataFrame's list cell: TRL's chat
    messages read from Parquet or ``Dataset.to_pandas()``) or scalar as its ``tolist()``, anything else as ``str``."""
    return x.tolist() if hasattr(x, "tolist") else str(x)


def _rows(data: Any, what: str) -> list[dict]:
    if hasattr(data, "to_list") and hasattr(data, "column_names"):  # a datasets.Dataset
        data = data.to_list()
    elif hasattr(data, "to_dict") and hasattr(data, "columns"):  # a pandas DataFrame (iterating it gives its columns)
        data = data.to_dict("records")
    if not isinstance(data, Iterable) or isinstance(data, Mapping):
        raise UserError(f"{what} is a {type(data).__name__}; give a list of dicts, a datasets.Dataset or a file path")
    rows = list(data)
    if not rows or not all(isinstance(r, Mapping) for r in rows):
        raise UserError(f"{what} must hold at least one row, each a dict of fields (e.g. prompt, answer)")
    return [dict(r) for r in rows]
