"""Typed pipeline configs loaded from YAML with dotted overrides.

Importing this never imports torch or Ray."""

from roll.config.common import (
    DataConfig,
    EvalConfig,
    ModelConfig,
    RayConfig,
    TinyModelConfig,
    TinyVisionConfig,
    TrackingConfig,
)
from roll.config.loader import PIPELINE_CONFIGS, ConfigError, load_config, to_yaml, validate
from roll.config.rlvr import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    RewardShapingConfig,
    RLVRConfig,
    RolloutConfig,
)
from roll.config.sft import SFTConfig, SFTTrainConfig

__all__ = [
    "PIPELINE_CONFIGS",
    "ActorConfig",
    "AlgorithmConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "RLVRConfig",
    "RayConfig",
    "RewardShapingConfig",
    "RolloutConfig",
    "SFTConfig",
    "SFTTrainConfig",
    "TinyModelConfig",
    "TinyVisionConfig",
    "TrackingConfig",
    "load_config",
    "to_yaml",
    "validate",
]
