"""slime's flags on the job: what ``inverted train`` does with the slime flags it was given.

``compat.slime_flags`` knows every flag of slime's ``train.py`` and what each does here; ``apply``
acts on the ones given, before any process starts:

- the ones inverted implements through its own config set it (``--num-steps-per-rollout`` the
  global batch, ``--rollout-max-context-len`` the context length, ``--log-probs-chunk-size`` the
  trainer's log-prob chunks, ``--sglang-max-running-requests``
  the embedded engines', ``--rm-type`` the reward model: slime's ``rm_hub.async_rm``), and
  ``--custom-config-path``'s YAML keys join ``args`` as in slime (keys that are inverted's flags
  set those, over the command line's, as slime's config overrides its args);
- the ones the trainer acts on set its typed loss settings: ``--use-opd`` with ``--opd-type`` and
  ``--opd-teacher-load`` on-policy distillation (``--distill``), ``--opd-kl-coef``,
  ``--disable-rewards-normalization`` (``--raw-rewards``), ``--calculate-per-token-loss``
  (``--per-token-loss``); on-policy distillation's are checked first as slime checks them, and
  Megatron's model-shape flags against the checkpoint;
- ``--sglang-*`` are planned for the backend the servers will run (``slime_flags.plan_sglang``);
- the ones that change nothing here are listed once, in the log, with why.

slime plug-ins see one ``args`` in every process: the job's flags under slime's names, the slime
flags given, and slime's defaults for the rest. ``cfg.train.plugin_args`` and
``cfg.buffer.plugin_args`` carry the flags to the trainer and the buffer service as JSON; no key or token
is in it (the buffer's travels on a command line), slime's ``--wandb-key`` neither.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from inverted.compat import slime_flags
from inverted.config import from_flags, read_yaml_mapping, to_flags
from inverted.controller.config import JobConfig
from inverted.errors import ConfigError

logger = logging.getLogger(__name__)

SECTIONS = ("train", "rollout", "buffer", "proxy", "servers", "loop")


def apply(cfg: JobConfig, flags: slime_flags.SlimeFlags | None, sglang_args: list[str], backend: str) -> list[str]:
    """Act on the given slime flags (see the module docstring); returns the ``--sglang-*`` flags
    (without the prefix) that real SGLang servers get."""
    given = dict(flags.given if flags else {})
    ours = {name for section in SECTIONS for name in to_flags(getattr(cfg, section))}
    if path := given.get("custom_config_path"):
        keys = read_yaml_mapping(path, "--custom-config-path")  # slime sets each key on args
        _set_flags(cfg, {k: v for k, v in keys.items() if k in ours}, f"--custom-config-path {path}")
        given |= {k: v for k, v in keys.items() if k not in ours}
    plan = slime_flags.plan_sglang(sglang_args, backend)
    for name, value in plan.settings.items():  # the embedded engines' own flags
        _set_once(cfg, ("servers",), name, value, f"--sglang-{name.replace('_', '-')}")
    given |= plan.slime
    if steps := given.get("num_steps_per_rollout"):
        samples = cfg.rollout.rollout_batch_size * cfg.buffer.n_samples_per_prompt
        if samples % steps:
            raise ConfigError(
                f"--num-steps-per-rollout {steps}: must divide --rollout-batch-size x "
                f"--n-samples-per-prompt = {samples}"
            )
        _set_once(cfg, ("train",), "global_batch_size", samples // steps, "--num-steps-per-rollout")
    if (chunk := given.get("log_probs_chunk_size", -1)) > 0:
        _set_once(cfg, ("train",), "logprob_chunk_size", chunk, "--log-probs-chunk-size")
    if length := given.get("rollout_max_context_len"):
        _set_once(cfg, ("servers",), "context_length", length, "--rollout-max-context-len")
    slime_flags.check_distillation(given, cfg.train.hf_checkpoint)
    _set_loss(cfg, given)
    if given.get("rm_type") and not cfg.rollout.custom_rm_path:  # slime's default reward path
        cfg.rollout.custom_rm_path = "slime.rollout.rm_hub.async_rm"
    slime_flags.check_model(given, cfg.train.hf_checkpoint)
    ignored = [*slime_flags.SlimeFlags(given).listing(), *plan.ignored]
    if ignored:
        logger.warning("slime flags accepted with no effect here:\n  %s", "\n  ".join(ignored))
    cfg.share()  # what slime's flags set in an owner, to the parts that need it too
    namespace: dict[str, Any] = {}
    for section in SECTIONS:
        namespace |= {k: v for k, v in to_flags(getattr(cfg, section)).items() if k != "plugin_args"}
    namespace = {k: v for k, v in (namespace | given).items() if not slime_flags.SECRET.search(k)}
    cfg.train.plugin_args = cfg.buffer.plugin_args = json.dumps(namespace)
    return plan.forward


def _set_loss(cfg: JobConfig, given: dict[str, Any]) -> None:
    """The trainer's typed settings from the slime flags it acts on."""
    loss = cfg.train.loss
    if given.get("use_opd"):
        loss.distill = "teacher" if given.get("opd_type") == "megatron" else "samples"
        loss.distill_teacher = given.get("opd_teacher_load") if loss.distill == "teacher" else None
    if "opd_kl_coef" in given:
        loss.distill_kl_coef = float(given["opd_kl_coef"])
    if given.get("rewards_normalization") is False:  # --disable-rewards-normalization
        loss.raw_rewards = True
    if given.get("calculate_per_token_loss"):
        loss.per_token_loss = True


def _set_flags(cfg: JobConfig, values: dict[str, Any], where: str) -> None:
    """Set inverted's own flags from slime's custom config, as slime sets its args (over the command
    line's, with a warning); each section is built again, so its checks run on the new values."""
    if not values:
        return
    logger.warning("%s sets inverted's flags %s", where, ", ".join(f"{k}={v!r}" for k, v in values.items()))
    for section in SECTIONS:
        part = getattr(cfg, section)
        flags = to_flags(part)
        if mine := {k: v for k, v in values.items() if k in flags}:
            setattr(cfg, section, from_flags(type(part), {**flags, **mine}))


def _set_once(cfg: JobConfig, sections: tuple[str, ...], name: str, value: Any, flag: str) -> None:
    """Set ``name`` in ``sections`` from a slime flag, unless inverted's own flag set it otherwise."""
    for section in sections:
        part = getattr(cfg, section)
        default = type(part).__dataclass_fields__[name].default
        current = getattr(part, name)
        if current not in (default, value):
            raise ConfigError(f"{flag} {value!r} disagrees with --{name.replace('_', '-')} {current!r}")
        setattr(part, name, value)
