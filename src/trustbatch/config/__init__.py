"""Typed run configuration: defaults, YAML files, ``key=value`` overrides, validation with one-line errors.

    cfg = load_config("examples/chain_sum.yaml", ["objective.name=grpo", "train.steps=50"])

The sections are ``config.sections``, ``Config`` and its loading ``config.load``, YAML reading ``config.yaml_io``;
every name is importable from ``trustbatch.config``.
"""

from .load import Config, _flatten, config_fields, dump_config, load_config, nearest_key
from .sections import (DataConfig, EvalConfig, Float, FreeDict, Int, LogConfig, LoraConfig, ModelConfig,
                       ObjectiveConfig, RewardConfig, RewardFunctionConfig, RolloutConfig, TaskConfig, TrainConfig)
from .yaml_io import read_yaml_file, yaml_dumps, yaml_loads

__all__ = ["Config", "DataConfig", "EvalConfig", "Float", "FreeDict", "Int", "LogConfig", "LoraConfig", "ModelConfig",
           "ObjectiveConfig", "RewardConfig", "RewardFunctionConfig", "RolloutConfig", "TaskConfig", "TrainConfig",
           "_flatten", "config_fields", "dump_config", "load_config", "nearest_key", "read_yaml_file", "yaml_dumps", "yaml_loads"]
