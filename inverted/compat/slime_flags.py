"""slime's command line on inverted: every flag of slime's ``train.py``, and what it does here.

slime's ``train.py`` parses about 1,660 flags: Megatron-LM's, slime's own, and SGLang's and
sgl-router's under ``--sglang-`` / ``--router-``. ``slime_flags.json`` lists each with its
default, read from slime's own parser by ``tools/slime_flags.py`` (the commits it read are in the
file). ``inverted train`` takes every one of them, and nothing is dropped without a word:

- a flag inverted has (``--lr``, ``--rollout-batch-size``, ...) is its own, with slime's meaning;
- ``SAME``: slime flags with slime's meaning that inverted implements through slime's ``args``
  (``--calculate-per-token-loss``, ``--apply-chat-template``, ``--custom-config-path``, ...);
- ``CHECKED``: Megatron's model-shape flags, which the HF config fixes here: each must equal the
  config's value (slime's own ``_hf_validate_args`` list, and a few more);
- ``NO_EFFECT``: accepted and recorded in ``args``, and listed once at start-up with why they
  change nothing here (GPU kernels, memory, logging services);
- ``REFUSED``: stops the job before anything starts, with the reason;
- any other slime flag is accepted when its value is slime's default (so it changes nothing),
  and refused otherwise: inverted does not implement what it would change.

``--sglang-*`` flags are planned by ``plan_sglang``: forwarded to real SGLang where SGLang 0.5.23
has the flag, mapped to the embedded engine's own where it has one, listed as ignored by the
embedded engine otherwise; slime's own (``--sglang-config``, ``--sglang-server-concurrency``, ...)
are handled like the rest.

Every flag, given or not, is in slime plug-ins' ``args`` with slime's default (``compat.slime.SlimeArgs``).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from inverted.errors import ConfigError

TABLE = Path(__file__).with_name("slime_flags.json")


@dataclass(frozen=True, slots=True)
class Flag:
    """One flag of slime's parser, as ``tools/slime_flags.py`` read it."""

    options: tuple[str, ...]
    dest: str
    default: Any
    kind: str  # "value", "switch" (store_true/false/const) or "bool" (--x / --no-x)
    source: str  # "megatron", "slime" or "sglang" (SGLang's ServerArgs and sgl-router's, as slime adds them)
    const: Any = None
    nargs: Any = None
    type: str | None = None
    choices: tuple[Any, ...] | None = None
    append: bool = False

    @property
    def name(self) -> str:
        return self.options[0]


@functools.cache
def flags() -> tuple[Flag, ...]:
    """slime's flags, in its parsers' order (two may share a destination: ``--x`` and ``--no-x``)."""
    convert: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "json": json.loads}
    out = []
    for row in json.loads(TABLE.read_text())["flags"]:
        row = dict(row, options=tuple(row["options"]), choices=tuple(row["choices"]) if "choices" in row else None)
        if isinstance(row["default"], str) and row.get("type") in convert:  # argparse converts a string default
            row["default"] = convert[row["type"]](row["default"])
        out.append(Flag(**row))
    return tuple(out)


@functools.cache
def table() -> dict[str, Flag]:
    """slime's flags by destination (the first, where two share one)."""
    by_dest: dict[str, Flag] = {}
    for flag in flags():
        by_dest.setdefault(flag.dest, flag)
    return by_dest


def read_from() -> dict[str, str]:
    """The commits and versions the table was read from."""
    return json.loads(TABLE.read_text())["read_from"]


# -- what each flag does here ----------------------------------------------------------------------

# slime flags with slime's meaning, implemented here through ``args`` (the reason says where).
SAME: dict[str, str] = {
    "calculate_per_token_loss": "a custom pg-loss reducer is told so, and its value is divided by the step's "
    "loss tokens instead of its samples, as Megatron does",
    "apply_chat_template": "slime Samples' prompts are the chat template's text, not the message list",
    "custom_config_path": "its YAML keys are set on args, as slime does",
    "num_steps_per_rollout": "sets --global-batch-size to the rollout's samples / N",
    "rollout_max_context_len": "sets --context-length (prompt and reply together)",
    "rewards_normalization": "--disable-rewards-normalization: advantages are the raw rewards, no group mean or std",
    "sglang_server_concurrency": "slime's GenerateState semaphore (x rollout GPUs / GPUs per engine)",
    "loss_mask_type": "read by slime.utils.mask_utils",
    "load_forge_rollout_data": "read by slime.rollout.forge_load",
    "rm_type": "slime's rule-based reward models (slime.rollout.rm_hub.async_rm) score the Samples, unless "
    "--custom-rm-path is given",
    "rm_url": "where the remote_rm reward model posts {prompt, response, label}",
    "use_opd": "on-policy distillation: each token's advantage minus --opd-kl-coef x (the trainer's log-prob - "
    "the teacher's), the teacher's from sample.teacher_log_probs",
    "opd_kl_coef": "the weight of on-policy distillation's reverse KL in the advantages",
    "opd_type": "where the teacher's log-probs come from: sglang, with the Samples (slime's on_policy_distillation "
    "plug-ins ask a teacher server); megatron, the trainer runs the teacher (--opd-teacher-load)",
    "opd_teacher_load": "the teacher's HF checkpoint (slime's: its Megatron conversion), of the policy's architecture",
    "train_backend": "Megatron-core is the only backend, as slime's default",
    "use_dynamic_batch_size": "micro-batches are always packed by token budget (--max-tokens-per-gpu)",
    "balance_data": "micro-batches are always balanced by tokens across data-parallel ranks",
    "use_tensorboard": "TensorBoard events are always written (OUTPUT_DIR), beside metrics.jsonl",
    "log_passrate": "the pass rate is always logged (rollout/pass_rate, eval/pass_rate)",
    "accumulate_allreduce_grads_in_fp32": "gradients are always reduced in fp32",
    "log_probs_chunk_size": "sets --logprob-chunk-size (tokens whose logits exist at once); slime's -1, whole "
    "logits, is --logprob-chunk-size 0, but the chunked path gives the same log-probs",
}

# Megatron's model-shape flags: checked against the HF config (attribute names; the first found).
CHECKED: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers",),
    "hidden_size": ("hidden_size",),
    "ffn_hidden_size": ("intermediate_size",),
    "num_attention_heads": ("num_attention_heads",),
    "num_query_groups": ("num_key_value_heads",),
    "kv_channels": ("head_dim",),
    "layernorm_epsilon": ("rms_norm_eps", "layer_norm_eps"),  # --norm-epsilon
    "rotary_base": ("rope_theta",),
    "vocab_size": ("vocab_size",),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "moe_router_topk": ("num_experts_per_tok",),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_shared_expert_intermediate_size": ("shared_expert_intermediate_size",),
    "untie_embeddings_and_output_weights": ("tie_word_embeddings",),  # the opposite of it
    "attention_dropout": ("attention_dropout",),
}

_SHAPE = "the model's architecture comes from the HF config (--hf-checkpoint)"
_KERNEL = "a GPU kernel or memory choice; the math trained is the same"
_LOGGING = "metrics go to OUTPUT_DIR/metrics.jsonl and TensorBoard (no Weights & Biases here)"
_DELTA = "weights are pushed whole, in flattened buckets (--update-weight-transport)"

NO_EFFECT: dict[str, str] = {
    **dict.fromkeys(
        (
            "swiglu",
            "add_bias_linear",
            "normalization",
            "group_query_attention",
            "position_embedding_type",
            "use_rotary_position_embeddings",
            "rotary_percent",
            "add_qkv_bias",
            "qk_layernorm",
            "layernorm_zero_centered_gamma",
            "attention_output_gate",
            "multi_latent_attention",
            "kv_lora_rank",
            "q_lora_rank",
            "qk_head_dim",
            "qk_pos_emb_head_dim",
            "v_head_dim",
            "rotary_scaling_factor",
            "mscale",
            "mscale_all_dim",
            "use_rope_scaling",
            "rotary_interleaved",
            "add_position_embedding",
            "moe_layer_freq",
            "moe_router_score_function",
            "moe_router_pre_softmax",
            "moe_router_topk_scaling_factor",
            "moe_router_num_groups",
            "moe_router_group_topk",
            "moe_router_enable_expert_bias",
            "moe_router_bias_update_rate",
            "moe_shared_expert_gate",
            "make_vocab_size_divisible_by",
            "spec",
            "mtp_num_layers",
            "max_position_embeddings",
            "seq_length",
            "moe_router_load_balancing_type",
            "moe_token_drop_policy",
            "moe_router_dtype",
            "model_name",
            "padded_vocab_size",
        ),
        _SHAPE,
    ),
    **dict.fromkeys(
        (
            "attention_backend",
            "attention_softmax_in_fp32",
            "moe_enable_deepep",
            "moe_grouped_gemm",
            "moe_permute_fusion",
            "moe_token_dispatcher_type",
            "gradient_accumulation_fusion",
            "masked_softmax_fusion",
            "apply_rope_fusion",
            "bias_swiglu_fusion",
            "bias_dropout_fusion",
            "transformer_impl",
            "overlap_cpu_optimizer_d2h_h2d",
            "optimizer_cpu_offload",
            "use_precision_aware_optimizer",
            "expert_tensor_parallel_size",
            "micro_batch_size",
            "data_pad_size_multiplier",
            "deterministic_mode",
            "offload_train",
            "offload_rollout",
            "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers",
            "allgather_cp",
            "fp8",
            "fp8_recipe",
            "fp8_param_gather",
            "overlap_grad_reduce",
            "overlap_param_gather",
            "num_gpus_per_node",
            "distributed_backend",
            "distributed_timeout_minutes",
            "train_env_vars",
            "check_for_nan_in_loss_and_grad",
            "sglang_router_request_timeout_secs",
        ),
        _KERNEL,
    ),
    **dict.fromkeys(
        (
            "use_wandb",
            "wandb_project",
            "wandb_group",
            "wandb_team",
            "wandb_host",
            "wandb_key",
            "wandb_mode",
            "wandb_dir",
            "wandb_random_suffix",
            "wandb_run_id",
            "wandb_always_use_train_step",
        ),
        _LOGGING,
    ),
    **dict.fromkeys(
        ("update_weight_delta_encoding", "update_weight_delta_checksum", "update_weight_local_checkpoint_dir"), _DELTA
    ),
    "ref_load": "the KL reference is the policy's starting weights, --hf-checkpoint (slime's --ref-load is "
    "usually that checkpoint converted for Megatron)",
    "keep_old_actor": "the old policy's log-probs are recomputed in each step from the weights that start it",
    "over_sampling_batch_size": "a round of sampling is --rollout-batch-size prompts: in async mode the Data Buffer "
    "samples continuously, and in sync mode --max-sampling-rounds refills a batch the "
    "filter thinned",
    **dict.fromkeys(
        ("min_lr", "lr_decay_iters", "lr_decay_samples"),
        "the learning rate is constant here (--lr-decay-style constant), so the decay's settings do not apply",
    ),
    "mtp_loss_scaling_factor": "no multi-token-prediction training here (--enable-mtp-training is refused)",
    "use_gated_attention": _SHAPE,
    "post_mlp_layernorm": _SHAPE,
    "post_self_attn_layernorm": _SHAPE,
}

# Flags of slime's models, not of its parser (slime's model providers read them): treated as Megatron's.
MODEL_FLAGS = ("use_gated_attention", "post_mlp_layernorm", "post_self_attn_layernorm")

REFUSED: dict[str, str] = {
    "data_source_path": "inverted's Data Buffer is a durable service (SQLite, leases, restarts); prompts come "
    "from --prompt-data, and --buffer-filter-path chooses which complete groups are trained",
    "rollout_all_samples_process_path": "Samples are stored in the Data Buffer as they finish; read them there "
    "(--save-debug-rollout-data) or in --custom-rollout-log-function-path",
    "rollout_data_postprocess_path": "the trainer computes log-probs inside its own step; change Samples before "
    "training with --rollout-sample-filter-path",
    "custom_convert_samples_to_train_data_path": "Samples are the training data itself: the trainer packs them "
    "(prefix sharing, balancing) and no dict of lists exists",
    "custom_megatron_init_path": "the trainer builds Megatron itself inside a Ray actor; not a plug-in point",
    "custom_megatron_before_log_prob_hook_path": "not a plug-in point of inverted's trainer",
    "custom_megatron_before_train_step_hook_path": "not a plug-in point of inverted's trainer",
    "use_rollout_logprobs": "inverted recomputes the old log-probs (or uses the live ones with one optimizer "
    "step); TIS (--use-tis) corrects against the rollout's",
    "compute_advantages_and_returns": "the trainer always computes the advantages (--advantage-estimator); "
    "give its rewards with --custom-reward-post-process-path",
    "enable_mtp_training": "no multi-token-prediction training here",
    "multimodal_keys": "text models only: no multimodal inputs",
    "rollout_buffer_url": "rollouts go through inverted's own Data Buffer (its URL is the job's)",
    "eval_config": "evaluation reads --eval-prompt-data with the rollout's keys; no per-dataset YAML",
    "update_weight_mode": _DELTA + "; no delta updates",
    "custom_update_weight_post_write_path": _DELTA + "; no hook after a disk write",
    "sglang_config": "inverted starts --num-engines identical servers (no server groups, no prefill/decode "
    "disaggregation)",
    "prefill_num_servers": "no prefill/decode disaggregation here",
    "sglang_router_ip": "inverted starts the job's own sgl-router (with its key); an external one is not used",
    "sglang_router_port": "inverted starts the job's own sgl-router (--router-port chooses its port)",
    "lr_decay_style": "the learning rate is constant here (only 'constant' is accepted)",
    "optimizer": "AdamW is the optimizer here (only 'adam' is accepted)",
    "hidden_dropout": "the trainer runs without dropout (only 0 is accepted)",
}

# Refused flags that are fine at one value (what inverted does anyway).
ACCEPTED_VALUES: dict[str, tuple[Any, ...]] = {
    "lr_decay_style": ("constant",),
    "optimizer": ("adam",),
    "hidden_dropout": (0.0,),
    "update_weight_mode": ("full",),
}


def option(dest: str) -> str:
    """The flag a destination is given by (``layernorm_epsilon``: ``--norm-epsilon``)."""
    flag = table().get(dest)
    return flag.name if flag else "--" + dest.replace("_", "-")


def status(dest: str, value: Any) -> tuple[str, str]:
    """``(status, why)`` of slime's flag ``dest`` given ``value``: status is ``same``, ``checked``,
    ``no effect``, ``default`` (slime's default: changes nothing) or ``refused``."""
    flag = table().get(dest)
    if dest in ACCEPTED_VALUES and value in ACCEPTED_VALUES[dest]:
        return "same", f"{value!r} is what inverted does"
    if dest in REFUSED:
        return "refused", REFUSED[dest]
    if dest in SAME:
        return "same", SAME[dest]
    if dest in CHECKED:
        return "checked", "must equal the HF config's " + " / ".join(CHECKED[dest])
    if dest in NO_EFFECT:
        return "no effect", NO_EFFECT[dest]
    if flag is not None and value == flag.default:
        return "default", "slime's default"
    owner = {"megatron": "Megatron-LM's", "slime": "slime's", "sglang": "SGLang's"}.get(flag.source if flag else "", "")
    return "refused", (
        f"{owner} flag, which inverted does not implement; only its default {flag.default!r} is accepted"
        if flag
        else "not a flag of slime's train.py either"
    )


# -- parsing ---------------------------------------------------------------------------------------


def _argparse_kwargs(flag: Flag) -> dict[str, Any]:
    if flag.kind == "bool":
        return {"action": argparse.BooleanOptionalAction}
    if flag.kind == "switch":
        return {"action": "store_const", "const": flag.const}
    kwargs: dict[str, Any] = {"type": {"int": int, "float": float, "json": json.loads}.get(flag.type or "", str)}
    if flag.nargs is not None:
        kwargs["nargs"] = flag.nargs
    if flag.append:
        kwargs["action"] = "append"
    return kwargs


def parser(ours: set[str]) -> argparse.ArgumentParser:
    """A parser of slime's flags that ``ours`` (inverted's destinations) does not hold; only what is
    given lands in its namespace."""
    slime = argparse.ArgumentParser(
        prog="inverted train", add_help=False, allow_abbrev=False, argument_default=argparse.SUPPRESS
    )
    taken = set()
    for flag in flags():
        options = [o for o in flag.options if o not in taken]
        options = [o for o in options if not o.startswith(("--sglang-", "--router-"))]  # split off before
        if flag.dest in ours or not options:
            continue
        taken.update(options)
        slime.add_argument(*options, dest=flag.dest, **_argparse_kwargs(flag))
    for dest in MODEL_FLAGS:
        slime.add_argument("--" + dest.replace("_", "-"), dest=dest, action="store_const", const=True)
    return slime


# Flags whose values are secrets (slime's --wandb-key): never logged, never on a command line.
SECRET = re.compile(r"(api_key|wandb_key|token|secret|password)$")


@dataclass(slots=True)
class SlimeFlags:
    """slime flags given on the command line that are not inverted's own, by destination."""

    given: dict[str, Any] = field(default_factory=dict)

    def listing(self) -> list[str]:
        """One line per given flag that changes nothing here, for the start-up log."""
        lines = []
        for dest, value in sorted(self.given.items()):
            state, why = status(dest, value)
            if state in ("no effect", "default"):
                lines.append(f"{option(dest)}={'(hidden)' if SECRET.search(dest) else repr(value)}: {why}")
        return lines


def parse(rest: list[str], ours: set[str]) -> SlimeFlags:
    """slime's flags among ``rest`` (what inverted's parser left), or a ``ConfigError`` naming the first
    one refused (with why) or not a flag at all."""
    namespace, unknown = parser(ours).parse_known_args(rest)
    if unknown:
        raise ConfigError(
            f"unrecognized arguments: {' '.join(unknown)} (neither inverted's flags nor slime's train.py's)"
        )
    given = vars(namespace)
    for dest, value in given.items():
        state, why = status(dest, value)
        if state == "refused":
            raise ConfigError(
                f"{option(dest)}={value!r} is a slime flag inverted does not have: {why} (docs/migrating-from-slime.md)"
            )
    return SlimeFlags(given)


def check_model(given: dict[str, Any], hf_checkpoint: str) -> None:
    """Megatron's shape flags must describe the checkpoint (slime's ``_hf_validate_args``, and more)."""
    config_file = Path(hf_checkpoint) / "config.json"
    if not config_file.exists():
        return
    config = json.loads(config_file.read_text())
    config = dict(config.get("text_config", config))
    config.setdefault(
        "rope_theta", (config.get("rope_parameters") or {}).get("rope_theta")
    )  # transformers 5 keeps it there
    errors = []
    for dest, names in CHECKED.items():
        if dest not in given:
            continue
        name = next((n for n in names if config.get(n) is not None), None)
        if name is None:
            continue
        expected = not config[name] if dest == "untie_embeddings_and_output_weights" else config[name]
        value = given[dest]
        if value != expected and not (isinstance(value, float) and abs(value - float(expected)) < 1e-12):
            errors.append(f"{option(dest)} {value!r} != {expected!r} ({name} in {config_file})")
    if errors:
        raise ConfigError("slime's model flags do not describe --hf-checkpoint: " + "; ".join(errors))


def check_distillation(given: dict[str, Any], hf_checkpoint: str) -> None:
    """slime's checks of on-policy distillation's flags; a Megatron-side teacher must have the policy's
    architecture (the trainer runs it on the policy's packed batches)."""
    teacher, kind = given.get("opd_teacher_load"), given.get("opd_type")
    if not given.get("use_opd"):
        if teacher is not None:
            raise ConfigError("--opd-teacher-load is set but --use-opd is not (slime's check)")
        return
    if kind is None:
        raise ConfigError(
            "--use-opd needs --opd-type: sglang (the teacher's log-probs come from a server during "
            "the rollout) or megatron (the trainer runs the teacher, --opd-teacher-load)"
        )
    if kind == "sglang" and teacher is not None:
        raise ConfigError(
            "--opd-teacher-load is for --opd-type megatron; with sglang the teacher is a server (--rm-url)"
        )
    if kind == "megatron":
        if teacher is None or not (Path(teacher) / "config.json").exists():
            raise ConfigError(
                f"--opd-type megatron needs --opd-teacher-load: the teacher's HF checkpoint directory (got {teacher!r})"
            )
        from inverted.hf_checkpoint import ModelSpec  # torch: not for every command line

        ours, theirs = ModelSpec.from_checkpoint(hf_checkpoint), ModelSpec.from_checkpoint(teacher)
        differ = [
            f"{f.name} {getattr(theirs, f.name)!r} != {getattr(ours, f.name)!r}"
            for f in fields(ours)
            if f.name not in ("eos_token_ids", "max_position_embeddings")
            and getattr(ours, f.name) != getattr(theirs, f.name)
        ]
        if differ:
            raise ConfigError(
                f"--opd-teacher-load {teacher}: the teacher must have the policy's architecture "
                f"(slime's requirement): {'; '.join(differ)}"
            )


# -- --sglang-* -------------------------------------------------------------------------------------

# slime's own --sglang-* flags (not SGLang's), and the embedded engine's flags for SGLang's.
SLIME_SGLANG = (
    "sglang_server_concurrency",
    "sglang_config",
    "sglang_router_ip",
    "sglang_router_port",
    "sglang_router_request_timeout_secs",
    "prefill_num_servers",
)
EMBEDDED: dict[str, str] = {
    "max_running_requests": "engine_max_running_requests",
    "context_length": "context_length",
    "dtype": "engine_dtype",
}


@dataclass(slots=True)
class SGLangPlan:
    """What becomes of the ``--sglang-*`` flags: forwarded to SGLang, set on inverted's config, or ignored."""

    forward: list[str] = field(default_factory=list)  # SGLang's own command line
    settings: dict[str, Any] = field(default_factory=dict)  # ServersConfig field -> value (embedded engine)
    slime: dict[str, Any] = field(default_factory=dict)  # slime's own flags, for args
    ignored: list[str] = field(default_factory=list)  # for the start-up log


def plan_sglang(passed: list[str], backend: str) -> SGLangPlan:
    """``passed``: what ``split_passthrough`` took from ``--sglang-*`` (``--x v``); ``backend``: "sglang"
    (real SGLang 0.5.23 gets its own flags) or "embedded"."""
    plan = SGLangPlan()
    parsed = argparse.ArgumentParser(add_help=False, allow_abbrev=False, argument_default=argparse.SUPPRESS)
    taken: set[str] = set()
    for flag in flags():  # SGLang's under --sglang-, and slime's own (the router's are --router-*, apart)
        options = [
            o.replace("--sglang-", "--", 1)
            for o in flag.options
            if o.startswith("--sglang-") or flag.dest in SLIME_SGLANG
        ]
        options = [o for o in options if o not in taken]
        if flag.source == "sglang" and options:
            taken.update(options)
            name = flag.dest[len("sglang_") :] if flag.dest.startswith("sglang_") else flag.dest
            parsed.add_argument(*options, dest=name, **_argparse_kwargs(flag))
    values, unknown = parsed.parse_known_args(passed)
    if unknown:
        words = " ".join(a if not a.startswith("--") else "--sglang-" + a[2:] for a in unknown)
        if backend == "sglang":
            raise ConfigError(
                f"{words}: not a flag slime passes to SGLang {read_from()['sglang']} (SGLang has no "
                "such flag, or slime sets it itself: the model, ports, TP size, seed)"
            )
        plan.ignored.append(
            f"{words}: not a flag slime passes to SGLang {read_from()['sglang']}; the embedded engine ignores it"
        )
    for name, value in vars(values).items():
        dest = f"sglang_{name}" if f"sglang_{name}" in table() else name
        if dest in SLIME_SGLANG:
            state, why = status(dest, value)
            if state == "refused":
                raise ConfigError(f"{option(dest)}={value!r}: {why} (docs/migrating-from-slime.md)")
            plan.slime[dest] = value
        elif backend == "sglang":
            plan.slime[dest] = value
        elif name in EMBEDDED:
            plan.settings[EMBEDDED[name]] = value
            plan.slime[dest] = value
        else:
            plan.slime[dest] = value
            plan.ignored.append(
                f"--sglang-{name.replace('_', '-')}={value!r}: a setting of real SGLang's server "
                "that the embedded engine does not have"
            )
    if backend == "sglang":
        own = {o for dest in SLIME_SGLANG if dest in table() for o in table()[dest].options}
        plan.forward = _without(passed, {o.replace("--sglang-", "--", 1) for o in own})
    return plan


def _without(argv: list[str], options: set[str]) -> list[str]:
    """``argv`` less the given options and their values."""
    out, skipping = [], False
    for arg in argv:
        if arg.split("=", 1)[0] in options:
            skipping = "=" not in arg
            continue
        if skipping and not arg.startswith("--"):
            continue
        skipping = False
        out.append(arg)
    return out


def describe(option_string: str) -> tuple[str, str]:
    """What ``inverted train`` does with slime's flag ``option_string`` given with a value other than
    slime's default (the migration table, and ``tools/slime_scripts.py``'s report)."""
    if option_string.startswith("--sglang-") or option_string == "--prefill-num-servers":
        flag = next((f for f in flags() if option_string in f.options), None)
        if flag is not None and flag.dest in SLIME_SGLANG:
            return status(flag.dest, _OTHER)
        name = option_string[len("--sglang-") :].replace("-", "_")
        if flag is None:
            return "no effect", (
                f"the embedded engine ignores it; refused with real SGLang, which has no such flag "
                f"in {read_from()['sglang']}"
            )
        if name in EMBEDDED:
            return "same", f"real SGLang's; the embedded engine's --{EMBEDDED[name].replace('_', '-')}"
        return "no effect", "forwarded to real SGLang; the embedded engine has no such setting and says so"
    dest = next(
        (f.dest for f in flags() if option_string in f.options),
        option_string[2:].replace("-", "_") if option_string[2:].replace("-", "_") in MODEL_FLAGS else None,
    )
    if dest is None:
        return "unrecognized", "not a flag of slime's train.py"
    state, why = status(dest, _OTHER)
    return (
        ("refused", "only slime's default is accepted: " + why)
        if state == "refused" and dest not in REFUSED
        else (state, why)
    )


_OTHER = object()  # a value that is no flag's default


def slime_forms(argv: list[str]) -> list[str]:
    """``argv`` with slime's multi-value forms of flags inverted takes one value of:
    ``--eval-prompt-data NAME PATH`` (slime names each evaluation set) becomes ``--eval-prompt-data
    PATH``. More than one set is refused: a job here evaluates one."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--eval-prompt-data":
            values = list(itertools.takewhile(lambda a: not a.startswith("--"), argv[i + 1 :]))
            if len(values) > 2:
                raise ConfigError(
                    f"--eval-prompt-data {' '.join(values)}: one evaluation set here (NAME PATH, or PATH)"
                )
            out += ["--eval-prompt-data", values[-1]] if values else [argv[i]]
            i += 1 + len(values)
            continue
        out.append(argv[i])
        i += 1
    return out
