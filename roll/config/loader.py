"""Load a pipeline config from YAML plus ``key=value`` overrides, strictly, before anything expensive starts.

OmegaConf does the YAML, interpolation (``${output_dir}``), type conversion and did-you-mean for unknown
keys; this module turns its exceptions into one ``ConfigError`` that names the key, and adds the
cross-field checks (batch sizes, paths, registry names) that no schema can express.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from roll.config.agentic import AgenticConfig, migrate_agent_env
from roll.config.devices import parse_mapping_strings
from roll.config.distill import DistillConfig
from roll.config.dpo import DPOConfig
from roll.config.fields import field_docs
from roll.config.rlvr import RLVRConfig
from roll.config.sft import SFTConfig
from roll.utils.plugins import import_plugins
from roll.utils.registry import Registry, did_you_mean

PipelineConfig = RLVRConfig | SFTConfig | AgenticConfig | DPOConfig | DistillConfig

PIPELINE_CONFIGS: Registry[type] = Registry("pipeline")
PIPELINE_CONFIGS.register("rlvr")(RLVRConfig)
PIPELINE_CONFIGS.register("sft")(SFTConfig)
PIPELINE_CONFIGS.register("agentic")(AgenticConfig)
PIPELINE_CONFIGS.register("dpo")(DPOConfig)
PIPELINE_CONFIGS.register("distill")(DistillConfig)

# Cross-field checks per config class; each returns a list of problems (empty when fine).
VALIDATORS: dict[type, Callable[[Any], list[str]]] = {}


class ConfigError(ValueError):
    """A config that cannot run; the message says which key is wrong and what to change."""


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> PipelineConfig:
    """Read ``path``, apply dotted ``overrides`` (``actor.lr=1e-5``), return the validated dataclass."""
    raw = _read_yaml(path)
    try:
        raw = OmegaConf.merge(raw, _parse_overrides(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad override: {e}") from None
    pipeline = raw.get("pipeline")
    if pipeline is None:
        raise ConfigError(f"{path}: set `pipeline:` to one of {', '.join(PIPELINE_CONFIGS.names())}")
    try:
        schema = PIPELINE_CONFIGS.get(str(pipeline))
    except KeyError as e:
        raise ConfigError(f"{path}: pipeline: {e.args[0]}") from None
    try:
        parse_mapping_strings(raw)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    if schema is AgenticConfig and (deprecated := migrate_agent_env(raw)) is not None:
        warnings.warn(f"{path}: {deprecated}", FutureWarning, stacklevel=2)
    config = _to_dataclass(schema, raw, source=str(path))
    try:
        import_plugins(config.imports, search_path=os.getcwd())
    except ImportError as e:
        raise ConfigError(f"{path}: imports: {e}") from None
    problems = validate(config)
    if problems:
        raise ConfigError(f"{path}: invalid config:\n" + "\n".join(f"  - {p}" for p in problems))
    return config


def validate(config: Any) -> list[str]:
    """Every cross-field problem of ``config`` (the checks that run before Ray or a model starts)."""
    return VALIDATORS[type(config)](config)


def to_yaml(config: Any, with_docs: bool = False) -> str:
    """The resolved config as YAML; with ``with_docs`` each key gets its one-line doc as a comment."""
    text = OmegaConf.to_yaml(OmegaConf.structured(config))
    if not with_docs:
        return text
    docs = field_docs(type(config))
    lines, stack = [], []
    for line in text.splitlines():
        stripped = line.lstrip()
        indent = (len(line) - len(stripped)) // 2
        key = stripped.split(":", 1)[0] if ":" in stripped and not stripped.startswith("- ") else None
        if key is None:
            lines.append(line)
            continue
        del stack[indent:]
        stack.append(key)
        doc = _lookup(docs, ".".join(stack), "")
        lines.append(f"{line}  # {doc}" if doc else line)
    return "\n".join(lines) + "\n"


def _read_yaml(path: str | os.PathLike, children: tuple[Path, ...] = ()) -> Any:
    """The YAML mapping at ``path``; a ``base: other.yaml`` key (relative to this file) is loaded first
    and this file's keys are merged over it, so a recipe states only how it differs from its base."""
    if not Path(path).is_file():
        what = "is a directory, not a YAML file" if Path(path).is_dir() else "does not exist"
        raise ConfigError(f"config file '{path}' {what}")
    try:
        raw = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and friends: report them the same way
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not OmegaConf.is_dict(raw):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys")
    base = raw.pop("base", None)
    if base is None:
        return raw
    base_path = Path(path).parent / str(base)
    chain = (*children, Path(path).resolve())
    if not base_path.is_file():
        what = "is a directory, not a YAML file" if base_path.is_dir() else "does not exist"
        raise ConfigError(f"{path}: `base: {base}` names {base_path}, which {what}")
    if base_path.resolve() in chain:
        raise ConfigError(f"{path}: `base: {base}` makes a cycle: {' -> '.join(map(str, chain))}")
    return OmegaConf.merge(_read_yaml(base_path, chain), raw)


def _parse_overrides(overrides: Sequence[str]) -> Any:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' must look like key=value, e.g. actor.lr=1e-5")
    return OmegaConf.from_dotlist(list(overrides))


def _to_dataclass(schema: type, raw: Any, source: str) -> Any:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), raw)
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{source}: `{e.full_key}` is required ({_doc(schema, e.full_key)})") from None
    except OmegaConfBaseException as e:
        # Some merge errors (e.g. a scalar where a section belongs) carry no key at all.
        where = f"`{e.full_key}`: " if getattr(e, "full_key", None) else ""
        raise ConfigError(f"{source}: {where}{_first_line(e)}{_unknown_key_hint(e, schema)}") from None


def _first_line(e: OmegaConfBaseException) -> str:
    message = str(e.msg if getattr(e, "msg", None) else e).splitlines()[0]
    return message.replace("Did you mean: ", "Did you mean ")


# Keys that an older config may still hold -> what replaced them.
REPLACED_KEYS = {
    "data.prompt_key": "data.columns.prompt (data.columns maps your column names onto ROLL's)",
    "data.response_key": "data.columns.answer (data.columns maps your column names onto ROLL's)",
}


def _unknown_key_hint(e: OmegaConfBaseException, schema: type) -> str:
    """OmegaConf suggests near-misses inside a section; at the top level add the section list. A key
    that was replaced names its replacement."""
    key = str(getattr(e, "full_key", "") or "")
    if key in REPLACED_KEYS:
        return f"; it was replaced by {REPLACED_KEYS[key]}"
    if "not in" not in str(e) or "." in key or "Did you mean" in str(e):
        return ""
    names = [f.name for f in dataclasses.fields(schema)]
    return "." + (did_you_mean(key, names) or f" Known keys: {', '.join(names)}")


def _doc(schema: type, key: str) -> str:
    return _lookup(field_docs(schema), key, "no default")


def _lookup(docs: dict[str, str], key: str, default: str) -> str:
    """The doc of ``key``; a key inside a named section (domains.math.train_path) is documented as
    domains.<name>.train_path."""
    parts = key.split(".")
    generic = ".".join([parts[0], "<name>", *parts[2:]]) if len(parts) > 2 else key
    return docs.get(key, docs.get(generic, default))


def _register_validators() -> None:
    from roll.config.agentic_checks import validate_agentic
    from roll.config.distill_checks import validate_distill
    from roll.config.dpo_checks import validate_dpo
    from roll.config.rl_checks import validate_rlvr
    from roll.config.validation import validate_sft

    VALIDATORS[RLVRConfig] = validate_rlvr
    VALIDATORS[SFTConfig] = validate_sft
    VALIDATORS[AgenticConfig] = validate_agentic
    VALIDATORS[DPOConfig] = validate_dpo
    VALIDATORS[DistillConfig] = validate_distill


_register_validators()
