"""Typed pipeline configs loaded from YAML with dotted overrides.

Importing this never imports torch or Ray."""

from roll.config.common import EvalConfig, ModelConfig, RayConfig, TinyModelConfig, TrackingConfig
from roll.config.loader import PIPELINE_CONFIGS, ConfigError, load_config, to_yaml, validate
from roll.config.rlvr import ActorConfig, AlgorithmConfig, RLVRConfig, RLVRDataConfig, RolloutConfig
from roll.config.sft import SFTConfig, SFTDataConfig, SFTTrainConfig

__all__ = [
    "PIPELINE_CONFIGS",
    "ActorConfig",
    "AlgorithmConfig",
    "ConfigError",
    "EvalConfig",
    "ModelConfig",
    "RLVRConfig",
    "RLVRDataConfig",
    "RayConfig",
    "RolloutConfig",
    "SFTConfig",
    "SFTDataConfig",
    "SFTTrainConfig",
    "TinyModelConfig",
    "TrackingConfig",
    "load_config",
    "to_yaml",
    "validate",
]
