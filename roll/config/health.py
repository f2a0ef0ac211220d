"""The ``health`` section of RL configs: run-health monitors over the metric stream (``roll.health``).

Every threshold is documented here with its default; docs/health.md says what each monitor watches and
what to try when it fires. The defaults were chosen so that none fires on the healthy quickstart and
agentic example runs (measured: docs/health.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from roll.config.fields import option
from roll.health import monitor_sections

# ``None``: the section's action is ``health.action``.
MonitorAction = Literal["warn", "stop"] | None
_ACTION_HELP = "warn or stop for this monitor (unset: health.action)."


@dataclass
class EntropyCollapseConfig:
    """The policy's token entropy (``actor/entropy``) falling to a small share of its early level: it has
    stopped exploring, and samples of one prompt become near-identical."""

    enabled: bool = option(True, help="Watch actor/entropy.")
    action: MonitorAction = option(None, help=_ACTION_HELP)
    fraction: float = option(
        0.05,
        gt=0,
        le=1,
        help="Fires when the smoothed entropy stays below this share of its early level (a run that "
        "learns a deterministic task halves or quarters it; a collapse takes it to a few percent).",
    )


@dataclass
class LengthRunawayConfig:
    """Responses growing until they hit ``rollout.max_new_tokens`` (truncated answers rarely score)."""

    enabled: bool = option(True, help="Watch response/length_mean and response/truncated_frac.")
    action: MonitorAction = option(None, help=_ACTION_HELP)
    growth: float = option(
        3.0,
        gt=1,
        help="Fires when the smoothed mean response length stays above this many times its early level.",
    )
    truncated_frac: float = option(
        0.5,
        gt=0,
        le=1,
        help="Also fires when the smoothed share of responses cut at rollout.max_new_tokens "
        "(response/truncated_frac, RLVR) stays at or above this.",
    )


@dataclass
class LengthCollapseConfig:
    """Responses shrinking toward nothing (an empty or one-token answer the reward cannot tell apart)."""

    enabled: bool = option(True, help="Watch response/length_mean.")
    action: MonitorAction = option(None, help=_ACTION_HELP)
    fraction: float = option(
        0.3,
        gt=0,
        le=1,
        help="Fires when the smoothed mean response length stays below this share of its early level.",
    )


@dataclass
class RewardHackingConfig:
    """The training reward rising while the held-out score falls: the policy exploits the reward."""

    enabled: bool = option(True, help="Watch reward/mean against eval/score at each evaluation.")
    action: MonitorAction = option(None, help=_ACTION_HELP)
    evals: int = option(
        4,
        ge=3,
        help="Evaluations (the one before training included) the two trends are fitted over (least squares).",
    )
    min_rise: float = option(
        0.05, gt=0, help="Least rise of the smoothed training reward over those evaluations (reward units)."
    )
    min_drop: float = option(
        0.05, gt=0, help="Least fall of eval/score over the same evaluations (score units)."
    )


@dataclass
class AllSameGroupsConfig:
    """Most prompt groups scoring the same for every sample: group baselines give them no gradient."""

    enabled: bool = option(True, help="Watch reward/all_same_group_frac.")
    action: MonitorAction = option(None, help=_ACTION_HELP)
    max_frac: float = option(
        0.95,
        gt=0,
        le=1,
        help="Fires when the smoothed share of all-same groups stays at or above this (all right: the "
        "prompts are too easy; all wrong: too hard).",
    )


@dataclass
class BlowupConfig:
    """A metric jumping far above its running median (or turning NaN/inf)."""

    enabled: bool = option(True, help="Watch this metric for blow-ups.")
    action: MonitorAction = option(None, help=_ACTION_HELP)
    factor: float = option(
        10.0, gt=1, help="Fires when the value is above this many times its running median ..."
    )
    steps: int = option(3, ge=1, help="... on this many steps in a row (a NaN or inf fires at once).")
    reference_steps: int = option(50, ge=1, help="The running median is over this many steps before those.")
    min_value: float = option(
        0.0, ge=0, help="Values at or below this are never a blow-up, however small the median."
    )


@dataclass
class EvalDropConfig:
    """A sustained fall of the held-out score from its best (eval/score and each eval/<domain>/score)."""

    enabled: bool = option(True, help="Watch eval/score and eval/<domain>/score.")
    action: MonitorAction = option(None, help=_ACTION_HELP)
    drop: float = option(
        0.1, gt=0, help="Fires when the score is more than this below its best so far (score units) ..."
    )
    evals: int = option(2, ge=1, help="... at this many evaluations in a row.")


@dataclass
class HealthConfig:
    """Run-health monitors: each watches the metrics every step, and when it sees trouble it says at
    which step, what it saw and what to try, logs ``health/<monitor>`` = 1 and writes
    ``<output_dir>/health/step_<N>_<monitor>.json`` (the recent metrics and example samples)."""

    action: Literal["warn", "stop"] = option(
        "warn",
        help="What a monitor that fires does: warn and go on, or stop the run after saving a checkpoint of "
        "the step (roll train then exits with code 3).",
    )
    baseline_steps: int = option(
        20,
        ge=1,
        help="A metric's early level is its median over its first N steps; nothing is judged before.",
    )
    window: int = option(
        10, ge=1, help="Per-step metrics are smoothed by a running median over this many steps."
    )
    patience: int = option(
        10,
        ge=1,
        help="Steps a smoothed metric must stay past its threshold before its monitor fires (and stay "
        "clear before it can fire again).",
    )
    entropy_collapse: EntropyCollapseConfig = field(
        default_factory=EntropyCollapseConfig, metadata={"help": "Policy entropy collapse."}
    )
    length_runaway: LengthRunawayConfig = field(
        default_factory=LengthRunawayConfig, metadata={"help": "Response length running away."}
    )
    length_collapse: LengthCollapseConfig = field(
        default_factory=LengthCollapseConfig, metadata={"help": "Response length collapsing."}
    )
    reward_hacking: RewardHackingConfig = field(
        default_factory=RewardHackingConfig, metadata={"help": "Training reward up, held-out score down."}
    )
    all_same_groups: AllSameGroupsConfig = field(
        default_factory=AllSameGroupsConfig, metadata={"help": "Most groups without a learning signal."}
    )
    kl_blowup: BlowupConfig = field(
        default_factory=lambda: BlowupConfig(min_value=0.1),
        metadata={"help": "KL to the reference (actor/kl, reward/kl) blowing up; min_value 0.1 nats/token."},
    )
    grad_norm_blowup: BlowupConfig = field(
        default_factory=BlowupConfig,
        metadata={"help": "Gradient norm before clipping (actor/grad_norm, critic/grad_norm) blowing up."},
    )
    eval_drop: EvalDropConfig = field(
        default_factory=EvalDropConfig, metadata={"help": "Sustained drop of the held-out score."}
    )


def check_health(health: HealthConfig) -> list[str]:
    """Settings that contradict each other: an action for a monitor that is off."""
    return [
        f"health.{name}.action={section.action} does nothing while health.{name}.enabled=false: enable the "
        f"monitor or remove its action"
        for name, section in monitor_sections(health).items()
        if section.action is not None and not section.enabled
    ]
