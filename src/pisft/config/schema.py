"""The run configuration's schema: one dataclass per section, the single source of keys, types,
defaults and marks; the keys it knows (`all_keys`, `keys_marked`, `fingerprint_keys`,
`nearest_key`), the data sources of `data.recap_dir`, and dotted keys over a config mapping
(`flatten`, `lookup`). Derived values (world size, gradient accumulation) are computed here, never
typed by hand."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

from pisft.config.choices import (
    AUGMENTS,
    AUTO,
    DEVICES,
    INFERENCE_PRECISIONS,
    LEROBOT_RTC_DEFAULTS,
    LORA_TARGETS,
    PRECISIONS,
    RECAP_INITS,
    RTC_SCHEDULES,
    THRESHOLD_SCOPES,
    TRAIN_COMPILE,
    VALUE_INITS,
    presets,
)
from pisft.config.marks import (
    ADVANTAGE,
    CLOSED_LOOP,
    COLLECTION,
    CONVERSION,
    DAG_SHAPE,
    DEMO,
    INPUT,
    OFFLINE_EVAL,
    POLICY_RUN,
    RETRAINING,
    ROLES,
    SMOKE_MEASURED,
    TRAIN_STEP,
    VALUE,
    VALUE_RUN,
    marked,
    roles_on,
)
from pisft.errors import PisftError


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-batches each process runs per optimizer step: a global batch of `global_batch` samples
    in micro-batches of `micro_batch` on `world_size` processes (the one place this is computed)."""
    return global_batch // (micro_batch * world_size)


class ConfigError(PisftError):
    """A configuration a user wrote is wrong; the message says where and what to do."""


@dataclass
class ModelConfig:
    # `tiny` (built locally, random init, fixed seed), a local directory in LeRobot layout,
    # or `hf://<repo_id>[@revision]` on the Hugging Face hub.
    source: str = marked("tiny", SMOKE_MEASURED, DAG_SHAPE)
    # Architecture preset: `tiny` (a few million parameters) or `pi05` (gemma_2b + gemma_300m); the
    # choices are read at each check (a model registered at run time adds its presets: choices.presets).
    preset: str = marked("tiny", SMOKE_MEASURED, choices=presets)
    # Tokenizer: "" means the source's own (the tiny preset builds one locally); else a local
    # directory or `hf://<repo_id>`.
    tokenizer: str = marked("", DAG_SHAPE)
    # Seed of the random initialisation of the tiny preset.
    init_seed: int = marked(0, kind="seed")
    # The asset id (e.g. `physical-intelligence/libero`) whose norm_stats.json fetch_base carries
    # into the base model, from openpi's `assets/<asset_id>/` or RLinf's `<asset_id>/`; "" carries
    # the only one (several: fetch_base lists them and carries none).
    asset_id: str = ""
    # Keep a source's chunk size when it differs from model.preset's (else that is an error).
    follow_source_chunk_size: bool = False
    # The discretised state in the prompt (LeRobot's pi0.5 always; openpi's pi05_libero:
    # discrete_state_input=False). The exported model records it and every consumer follows the
    # record; a starting model that records it (a source's discrete_state_input) is followed.
    state_in_prompt: bool = True


@dataclass
class DataConfig:
    # RECAP-format LIBERO dataset(s) (LeRobot layout): one directory (demonstrations, type `sft`),
    # or a list of typed sources, each a directory or `{path: DIR, type: sft|rollout, weight: W}`
    # (`data_sources()`; weight: the source's sampling weight, default 1.0). The default is
    # written by `demo_recap`.
    recap_dir: Any = marked("results/demo_recap", CONVERSION, INPUT, DAG_SHAPE)
    # RLinf's balance_dataset_weights (ReCapMixtureDataset): a source is drawn with probability
    # proportional to weight x its training frames (true) or to its weight alone (false). Recorded in
    # the dataset (meta/source_sampling.json), read by training.
    balance_source_weights: bool = marked(True, CONVERSION)
    # Synthetic demo data (used only when recap_dir is the demo directory).
    demo_episodes_per_task: int = marked(6, DEMO, INPUT, kind="count")
    demo_episode_length: int = marked(40, DEMO, INPUT, kind="count")
    demo_failure_fraction: float = marked(0.2, DEMO, INPUT, kind="fraction")
    demo_image_size: int = marked(64, DEMO, INPUT, kind="side")
    demo_seed: int = marked(0, DEMO, INPUT, kind="seed")
    # Conversion options.
    success_only: bool = marked(False, CONVERSION)
    tasks: list[str] = marked([], CONVERSION)
    advantage_tag: str = marked("", CONVERSION)
    # RLinf's CFG recipe for advantage prompts (used when advantage_tag is set): negative frames
    # get the plain task; a label is dropped at random with this probability during training.
    # Recorded in the dataset (meta/prompt_conditioning.json), read by training; retraining at
    # iteration k >= 1 turns the labels into prompts with them.
    positive_only_conditional: bool = marked(True, CONVERSION, RETRAINING)
    unconditional_prob: float = marked(0.1, CONVERSION, RETRAINING, kind="probability")
    # The dataset's column for image, wrist_image, state, actions when no known LIBERO naming fits.
    columns: dict[str, str] = marked({}, CONVERSION)
    image_size: int = marked(0, CONVERSION, kind="side_or_keep")  # 0 keeps the input resolution
    eval_fraction: float = marked(0.2, CONVERSION, kind="fraction",
                                  note="0: every episode trains and `evaluate` writes a \"not run\" result")
    split_seed: int = marked(0, CONVERSION, kind="seed")
    # Training-time image augmentation (pisft.data.augment), read by the training stages only:
    # `none`, or `openpi` (openpi's crop, rotation and colour jitter, drawn per sample): the images
    # every step trains on (the value model's too).
    augment: str = marked("none", TRAIN_STEP, VALUE, choices=AUGMENTS,
                          note="none: the images as they are; openpi: openpi's training-time crop, rotation and "
                               "colour jitter")


@dataclass
class SmokeConfig:
    steps: int = marked(4, kind="two_or_more", note="the smoke run checks the loss falls")
    # The smoke stage fails when less than this fraction of device memory would remain free.
    min_memory_headroom: float = marked(0.05, kind="fraction")


@dataclass
class TrainConfig:
    """The training run. In its run's fingerprint (`POLICY_RUN`, `VALUE_RUN`: a checkpoint of other
    values is not resumed) is what changes what training computes; not in it (a run resumes across
    them): the world size and everything that only splits the same computation differently
    (nproc_per_node, nnodes, micro_batch_size -> accumulation; the global batch is in), how often
    values are fetched or saved (log_every, save_every, keep_last), data-loader workers (each sample
    is drawn from (seed, step, position), not from worker order), peak_flops, tensorboard,
    deterministic (kernel choice, not the math), and activation checkpointing (recomputes the same
    forward with the same RNG state: same values). `compile` is in the policy's: compiled blocks
    compute in another order (the CPU's fp32 losses leave eager's in the 7th digit, docs/ascend.md),
    and the fingerprint holds the mode the run executes, `auto` as the smoke gate decided it
    (pisft.train.decisions). Each checkpoint and the export record which steps ran under which
    micro batch, checkpointing and world size (pisft.train.step_record). The value run has its own
    steps, learning rates, batch and mode (`recap.value_*`)."""

    nproc_per_node: int = marked(2, TRAIN_STEP, kind="count")
    nnodes: int = marked(1, kind="count")
    node_rank: int = marked(0, kind="count_or_zero")
    rdzv_endpoint: str = ""
    # A number, or `auto`: the largest that fits the device, chosen by smoke_1card from measured
    # peaks (pisft.gates.micro_batch); train_8card (and the RECAP value model) run the report's choice.
    micro_batch_size: int | str = marked(4, TRAIN_STEP, kind="count", choices=(AUTO,),
                                         refusal="must be a number of samples or auto (the largest that fits the "
                                                 "device, chosen by smoke_1card)")
    global_batch_size: int = marked(16, TRAIN_STEP, POLICY_RUN, kind="count")
    steps: int = marked(150, POLICY_RUN, kind="count")
    save_every: int = marked(50, kind="count")
    keep_last: int = marked(2, kind="count")
    # The advantage labelling's value model runs in it too.
    precision: str = marked("fp32", TRAIN_STEP, ADVANTAGE, POLICY_RUN, VALUE_RUN, choices=PRECISIONS)
    seed: int = marked(0, TRAIN_STEP, POLICY_RUN, VALUE_RUN, kind="seed")
    lr: float = marked(1e-3, TRAIN_STEP, POLICY_RUN, VALUE_RUN, kind="positive", what="the peak learning rate")
    warmup_steps: int = marked(10, POLICY_RUN, VALUE_RUN, kind="count_or_zero")
    decay_lr: float = marked(1e-4, POLICY_RUN, VALUE_RUN, kind="non_negative",
                             what="the learning rate the schedule decays to")
    weight_decay: float = marked(1e-2, TRAIN_STEP, POLICY_RUN, VALUE_RUN, kind="non_negative")
    grad_clip: float = marked(1.0, TRAIN_STEP, POLICY_RUN, VALUE_RUN, kind="positive", what="the gradient-norm limit")
    # EMA of the trained weights (pisft.train.ema; openpi's ema_decay): 0 or null is off; on, the
    # exported model is the average, and every checkpoint carries it.
    ema_decay: float | None = marked(0.0, POLICY_RUN, kind="decay_or_off", what="the EMA's decay",
                                     note="0 or null: no EMA; openpi's pi05_libero: 0.999")
    # true | false | auto: off where the memory allows it at the chosen micro batch (smoke_1card decides).
    activation_checkpointing: bool | str = marked(False, TRAIN_STEP, choices=(AUTO,),
                                                  refusal="must be true, false or auto (off where the memory allows "
                                                          "it, chosen by smoke_1card)")
    # Peak dense bf16 FLOP/s of one device for MFU; 0 looks the device up in a table.
    peak_flops: float = marked(0.0, TRAIN_STEP, kind="non_negative", note="0: the device table's figure")
    # Data-loader worker processes per training process; -1 chooses from the cores
    # (pisft.train.batches.default_workers). prefetch_factor: micro-batches each worker prepares ahead.
    num_workers: int = marked(-1, TRAIN_STEP, kind="auto_or_count", what="data-loader processes per training process")
    prefetch_factor: int = marked(4, kind="count", what="micro-batches each data-loader worker prepares ahead")
    # The smallest FSDP unit, in parameters: smaller layer units are merged with their neighbours
    # of the same group (pisft.train.fsdp.merge_small_units). -1 chooses by device: on the CPU
    # 16M (gloo collectives cost milliseconds each; the tiny model trains with the root unit
    # alone), on an accelerator 0 (one unit per decoder layer pair and per vision layer). The
    # smoke run measures this layout.
    fsdp_min_unit_params: int = marked(-1, TRAIN_STEP, kind="auto_or_count",
                                       what="the smallest FSDP unit in parameters")
    # Also write the per-step metrics as TensorBoard scalars (results/checkpoints/train/<run>/tensorboard;
    # needs the `tensorboard` package).
    tensorboard: bool = False
    # Fetch the step metrics from the device every this many optimizer steps (and at checkpoints
    # and the last step): one device->host synchronisation per fetch. metrics.jsonl still has
    # one line per optimizer step. Host syncs per step: the smoke run's step time and projection.
    log_every: int = marked(10, TRAIN_STEP, kind="count")
    # Deterministic training: torch.use_deterministic_algorithms(True), HCCL_DETERMINISTIC=true on
    # Ascend, CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA. Slower; config/README.md has the costs.
    deterministic: bool = marked(False, TRAIN_STEP)
    # What trains (pisft.train.trainable; the modes' table: TRAINABLE_MODE_TABLE): all | expert
    # (LeRobot's train_expert_only: the PaliGemma VLM frozen, the action expert and the action/time
    # projections train) | no_vision (LeRobot's freeze_vision_encoder) | lora (LoRA adapters through
    # peft on train.lora_targets' modules). The step's gradients, optimizer state and memory follow it.
    trainable: str = marked("all", TRAIN_STEP, POLICY_RUN)
    # train.trainable: lora (or recap.value_trainable: lora): the target preset, lerobot (LeRobot's
    # pi0.5 defaults) | openpi (gemma_2b_lora + gemma_300m_lora) | rlinf (RLinf's is_lora list).
    lora_targets: str = marked("openpi", TRAIN_STEP, POLICY_RUN, VALUE_RUN, choices=LORA_TARGETS)
    # The adapters' rank and alpha (scaling alpha / rank); 0: the preset's own (lerobot 16 / 8;
    # openpi 16 / 16 on the VLM, 32 / 32 on the expert; rlinf 32 / 32). A rank given replaces all
    # of the preset's ranks; alpha 0 then is LeRobot's 8 (lerobot) or the rank (openpi, rlinf).
    lora_rank: int = marked(0, TRAIN_STEP, POLICY_RUN, VALUE_RUN, kind="lora_rank")
    lora_alpha: float = marked(0.0, TRAIN_STEP, POLICY_RUN, VALUE_RUN, kind="non_negative", note="0: the preset's own")
    # torch.compile of the training step's repeated blocks (pisft.train.blocks): off | layers (each
    # decoder layer pair and SigLIP encoder layer compiled, as torchtitan compiles each block) | auto
    # (decided by smoke_1card on the run's device: the smoke steps eager and compiled, compiled kept
    # only when it ran, agreed with eager and was faster, pisft.gates.compile_trial; on the CPU eager
    # without a trial). Compiled code is cached under results/cache/inductor. The step's time, memory
    # and last bits follow it; the mode the run executes is in its fingerprint.
    compile: str = marked("auto", TRAIN_STEP, POLICY_RUN, choices=TRAIN_COMPILE)


_RTC = LEROBOT_RTC_DEFAULTS  # RtcConfig's guidance defaults: LeRobot's, one constant (pisft.config.choices)


@dataclass
class RtcConfig:
    """Real-time chunking (LeRobot's RTC, `lerobot.policies.rtc`) in closed_loop, and the closed
    loop's simulated inference delay (pisft.rollout.chunking). The defaults of execution_horizon,
    max_guidance_weight and schedule are LeRobot 0.6.1's `RTCConfig`'s (`LEROBOT_RTC_DEFAULTS`)."""

    # Each chunk after an episode's first is inpainted to agree with the unexecuted rest of the one
    # before (LeRobot's RTCProcessor); closed_loop then also runs plain chunking at the same delay.
    enabled: bool = False
    # The inference delay in control steps: the environment keeps executing the previous chunk this
    # many steps while the next is computed (0: openpi's synchronous loop).
    delay_steps: int = marked(0, kind="count_or_zero", what="the inference delay in control steps",
                              note="0: openpi's synchronous loop")
    # LeRobot's RTC guidance window: the first delay_steps actions are held to the previous chunk,
    # the weights then fall to 0 at this index (it must exceed delay_steps under RTC).
    execution_horizon: int = marked(_RTC["execution_horizon"], kind="count",
                                    note=f"LeRobot's default: {_RTC['execution_horizon']}")
    max_guidance_weight: float = marked(_RTC["max_guidance_weight"], kind="positive",
                                        note=f"LeRobot's default: {_RTC['max_guidance_weight']}")
    schedule: str = marked(_RTC["schedule"], choices=RTC_SCHEDULES,
                           note=f"LeRobot's RTCAttentionSchedule; its default: {_RTC['schedule']}")


@dataclass
class EvalConfig:
    # At most this many held-out episodes (0: all of them).
    max_episodes: int = marked(0, OFFLINE_EVAL, kind="count_or_zero", note="0: every held-out episode")
    batch_size: int = marked(32, OFFLINE_EVAL, kind="count")
    # Offline: evaluate every k-th frame of each held-out episode (1: every frame).
    frame_stride: int = marked(2, OFFLINE_EVAL, kind="count")
    # Seed of the flow-matching noise (fixed per frame, same for both models) and the bootstrap.
    seed: int = marked(0, OFFLINE_EVAL, kind="seed")
    # Bootstrap resamples of the held-out episodes for confidence intervals (0: none).
    bootstrap_samples: int = marked(1000, OFFLINE_EVAL, kind="count_or_zero")
    # Closed-loop LIBERO (stage closed_loop; needs the LIBERO simulator, MUJOCO_GL=egl).
    closed_loop: bool = marked(False, CLOSED_LOOP, DAG_SHAPE)
    libero_suites: list[str] = marked(["libero_spatial", "libero_object", "libero_goal", "libero_10"], CLOSED_LOOP)
    # Collection starts from the initial states after the evaluation's.
    trials_per_task: int = marked(50, CLOSED_LOOP, COLLECTION, kind="count")
    replan_steps: int = marked(5, CLOSED_LOOP, COLLECTION, kind="count")
    num_wait_steps: int = marked(10, CLOSED_LOOP, COLLECTION, kind="count_or_zero")
    closed_loop_seed: int = marked(7, CLOSED_LOOP, kind="seed")
    # The closed loop's seeds (each an environment seed and the root of the policy's noise seeds); []: the
    # one eval.closed_loop_seed, which a list must start with. Success is pooled over them, each beside it.
    seeds: list[int] = marked([], CLOSED_LOOP, kind="seed")
    # The closed loop's episodes again under each perturbation (docs/robustness.md): a name (its default
    # strength) or {name: NAME, strength: S}, names and strengths in PERTURBATIONS; []: openpi's protocol alone.
    perturbations: list[Any] = marked([], CLOSED_LOOP)
    # Images are resized with padding to this square size before they reach the policy (openpi).
    resize_size: int = marked(224, CLOSED_LOOP, COLLECTION, kind="side")
    # Step limit of every episode; 0: openpi's limit of each suite (220/280/300/520, libero_90 400).
    max_steps: int = marked(0, CLOSED_LOOP, kind="count_or_zero", note="0: openpi's limit per suite")
    # Task ids evaluated in each suite; empty: every task.
    task_ids: list[int] = marked([], CLOSED_LOOP, kind="count_or_zero")
    # Environment worker processes; 0: one per core available to the stage. Like
    # policy_batch_wait_ms and policy_devices it changes how fast, not what (pisft.policy.fixed_shape).
    num_envs: int = marked(0, kind="count_or_zero", note="0: one per available core")
    # The rows of every policy forward: up to this many waiting requests share one, which is padded
    # to it when fewer wait (1: one at a time). A forward rounds by its rows, so results depend on
    # this and on nothing of the timing (pisft.policy.fixed_shape).
    policy_batch: int = marked(2, CLOSED_LOOP, COLLECTION, kind="count", what="the rows of every policy forward",
                               note="0, every environment waiting, is gone: a forward's rows change its rounding, "
                                    "so they are fixed; e.g. 2, or about eval.num_envs per policy replica; "
                                    "docs/libero.md")
    # How long a batch that could still grow (environments still simulating) is held: 0 measured
    # (pisft.policy.batching), a positive number of ms set by hand.
    policy_batch_wait_ms: float = marked(0.0, kind="non_negative", note="0: measured")
    # Policy replicas, one per accelerator (0: every visible device of `device`'s kind; the CPU: one).
    policy_devices: int = marked(0, kind="count_or_zero", note="0: every visible device")
    # The jobs closed_loop and collect_rollouts are each scattered over (pisft.rollout.plan, "Scattered
    # rollouts"): each runs a block of the episodes, a merge writes the outputs; the same bytes for any
    # number. 1: one job, as before.
    shards: int = marked(1, kind="count", what="the jobs the rollouts are scattered over", note="1: one job")
    # An MP4 (agent view | wrist camera) of the first episode of each task.
    videos: bool = marked(True, CLOSED_LOOP)
    # Classifier-free guidance of an advantage-conditioned policy (RLinf's cfgrl_guidance_scale):
    # 1.0 prompts with the positive tag alone; w > 1 blends v = (1 - w) v_uncond + w v_cond.
    cfg_scale: float = marked(1.0, OFFLINE_EVAL, CLOSED_LOOP, COLLECTION, kind="at_least_one",
                              what="the guidance scale", note="1: the positive prompt alone")
    # The action chunk compiled and graph-captured per batch-size bucket (pisft.policy.compiled), in
    # evaluate, closed_loop and collect_rollouts (serve --compile): true, false, or null (the default):
    # on an accelerator the stage's first chunk runs eager and compiled and the faster is chosen
    # (actions within tolerance; recorded in the stage's output), on the CPU eager without a trial
    # (pisft.policy.compiled.Trial, CPU_DEFAULT). The same actions within its tolerance, not the same bits.
    compile: bool | None = marked(None, OFFLINE_EVAL, CLOSED_LOOP, COLLECTION)
    # Inference precision: bf16 (openpi's: fp32 only where openpi keeps it), fp32, or auto (bf16 on an
    # accelerator; on the CPU, the precision the model directory records).
    precision: str = marked("auto", OFFLINE_EVAL, CLOSED_LOOP, COLLECTION, choices=INFERENCE_PRECISIONS,
                            note="auto: bf16 on an accelerator, the model's own on the CPU")
    rtc: RtcConfig = marked(RtcConfig, CLOSED_LOOP)



@dataclass
class RecapConfig:
    """The RECAP loop around the SFT run (README, "The RECAP loop"): iteration k >= 1 rolls
    policy k-1 out, trains a value model on the pool, labels advantages, retrains, evaluates."""

    # Iterations after the SFT run (iteration 0); 0 runs the SFT pipeline alone.
    iterations: int = marked(0, DAG_SHAPE, kind="count_or_zero")
    # collect_rollouts: LIBERO suite and task ids rolled out, episodes per task, step limit
    # (0: the suite's limit). Collection starts from initial states after the evaluation's
    # (state eval.trials_per_task + i for episode i) and seeds from collect_seed.
    suite: str = marked("libero_10", COLLECTION)
    task_ids: list[int] = marked([0], COLLECTION, kind="count_or_zero")
    episodes_per_task: int = marked(2, COLLECTION, kind="count")
    max_steps: int = marked(0, COLLECTION, kind="count_or_zero", note="0: the suite's limit")
    collect_seed: int = marked(1000, COLLECTION, kind="seed")
    # Returns as RLinf computes them: -1 per step, 0 (success) or failure_reward at the end; written
    # beside the converted dataset (returns.parquet).
    gamma: float = marked(1.0, CONVERSION, ADVANTAGE, kind="discount", what="the discount")
    failure_reward: float = marked(-300.0, CONVERSION, kind="penalty",
                                   what="the reward of a failed episode's last step",
                                   note="RLinf: -300; returns are float32, a larger penalty drowns the -1 of each step")
    # train_value: the distributional value model (bins on [-1, 0]).
    value_bins: int = marked(201, VALUE, VALUE_RUN, kind="two_or_more", note="a distribution needs at least 2 bins")
    value_steps: int = marked(50, VALUE, VALUE_RUN, kind="count")
    value_lr: float = marked(5e-5, VALUE, VALUE_RUN, kind="positive")
    value_head_lr: float = marked(1e-4, VALUE, VALUE_RUN, kind="positive")
    # 0: train.global_batch_size (the value run's fingerprint holds the batch it resolves to)
    value_global_batch_size: int = marked(0, VALUE, kind="count_or_zero", note="0: train.global_batch_size")
    # advantages: N-step lookahead, the positive fraction, where the threshold is taken (not
    # eval.batch_size, train.num_workers: they change how fast, not what).
    lookahead: int = marked(10, ADVANTAGE, kind="count", what="the N of the N-step advantage",
                            note="with 0 every frame's advantage is 0: no labelling can tell frames apart")
    positive_quantile: float = marked(0.3, ADVANTAGE, kind="open_fraction",
                                      what="the fraction of frames labelled positive")
    threshold_scope: str = marked("global", ADVANTAGE, choices=THRESHOLD_SCOPES,
                                  note="global: one threshold over all frames, as RLinf; task: one per task, as the "
                                       "paper")
    # The fraction of the pool's episodes (per task) held out from the value model to measure it
    # (held-out rho, bin accuracy), at iteration k >= 1; the retrained policy trains on every
    # episode of the pool either way. 0: the value model trains on the whole pool too (RLinf) and
    # its held-out figures are skipped.
    holdout_fraction: float = marked(0.0, kind="fraction",
                                     note="0: the value model trains on the whole pool and its held-out figures are "
                                          "skipped")
    # Retraining at iteration k starts from the base model or from policy k-1.
    init: str = marked("previous", RETRAINING, DAG_SHAPE, choices=RECAP_INITS)
    # What the value model of iteration k starts from: the base model (RLinf's value model starts
    # from its pretrained backbone) or policy k-1 (`pisft.layout.value_init_model`); the value run's
    # fingerprint holds the content of the model it names too.
    value_init: str = marked("base", VALUE, VALUE_RUN, DAG_SHAPE, choices=VALUE_INITS,
                             note="base: the value model starts from the base model, as RLinf's from its pretrained "
                                  "backbone; previous: from the policy of iteration k - 1")
    # Optimizer steps of the retraining at iteration k >= 1; 0: train.steps (the SFT run's).
    policy_steps: int = marked(0, RETRAINING, kind="count_or_zero", note="0: train.steps")
    # What of the value model trains (TRAINABLE_MODE_TABLE): all | no_vision (SigLIP frozen) | head
    # (the VLM prefix frozen, the read-out token and bin head train: RLinf's value-model freeze_vlm) |
    # lora (adapters on the VLM part of train.lora_targets, the read-out token and head in full).
    value_trainable: str = marked("all", VALUE, VALUE_RUN)


@dataclass
class PisftConfig:
    device: str = marked("auto", DAG_SHAPE, choices=DEVICES)
    results_dir: str = "results"
    # `model` and `data` enter both run fingerprints whole (a key added there is covered by
    # default), their INPUT keys excepted; the value model reads all of `train` (the process layout,
    # micro batch, precision, seed and schedule shape).
    model: ModelConfig = marked(ModelConfig, POLICY_RUN, VALUE_RUN)
    data: DataConfig = marked(DataConfig, POLICY_RUN, VALUE_RUN)
    smoke: SmokeConfig = field(default_factory=SmokeConfig)
    train: TrainConfig = marked(TrainConfig, VALUE)
    eval: EvalConfig = field(default_factory=EvalConfig)
    recap: RecapConfig = field(default_factory=RecapConfig)

    # The RECAP iteration a stage runs for (set by `--iteration K`, never a config key): 0 is the
    # SFT run; k >= 1 reads and writes its own folder (`results()`).
    iteration: ClassVar[int] = 0

    # ---- derived values: computed, never typed by hand ----
    @property
    def world_size(self) -> int:
        return self.train.nproc_per_node * self.train.nnodes

    @property
    def value_global_batch_size(self) -> int:
        """Samples per value-model optimizer step: recap.value_global_batch_size, 0 meaning
        train.global_batch_size."""
        return self.recap.value_global_batch_size or self.train.global_batch_size

    @property
    def grad_accum_steps(self) -> int | None:
        """None while train.micro_batch_size is `auto` (the smoke gate chooses it)."""
        if self.train.micro_batch_size == AUTO:
            return None
        return accumulation_steps(self.train.global_batch_size, self.train.micro_batch_size, self.world_size)

    def at_iteration(self, k: int) -> PisftConfig:
        """This config as iteration k's stages see it (a copy; `iteration` set, and at k >= 1
        `train.steps` is `recap.policy_steps` when that is set)."""
        import copy

        if k < 0 or k > self.recap.iterations:
            raise ConfigError(f"iteration {k}: recap.iterations is {self.recap.iterations}, so iterations "
                              f"0..{self.recap.iterations} exist")
        out = copy.copy(self)
        out.iteration = k
        if k and self.recap.policy_steps:  # the retraining's own length (RLinf's CFG run has its own)
            out.train = dataclasses.replace(self.train, steps=self.recap.policy_steps)
        return out


@dataclass(frozen=True)
class DataSource:
    """One RECAP dataset of `data.recap_dir`: its folder and type (`sft`: demonstrations, all
    frames successful and positive; `rollout`: policy rollouts with `is_success`), and its
    sampling weight in the pool (`pisft.data.source_weights`)."""

    path: str
    type: str = "sft"
    weight: float = 1.0


def data_sources(cfg: PisftConfig) -> list[DataSource]:
    """`data.recap_dir` as a list of typed sources (a single directory: one `sft` source)."""
    value = cfg.data.recap_dir
    items = value if isinstance(value, list | tuple) else [value]
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(DataSource(item))
        else:
            out.append(DataSource(str(item["path"]), str(item.get("type", "sft")), float(item.get("weight", 1.0))))
    return out


@functools.cache
def _schema() -> dict[str, tuple[bool, tuple[str, ...]]]:
    """Every key and section of the schema (`train`, `train.lr`), in its order: whether it is a
    section (a config dataclass), and its marks."""
    out: dict[str, tuple[bool, tuple[str, ...]]] = {}

    def walk(schema: type, prefix: str) -> None:
        for f in fields(schema):
            dotted = f"{prefix}{f.name}"
            sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            out[dotted] = (is_dataclass(sub), roles_on(f))
            if is_dataclass(sub):
                walk(type(sub), dotted + ".")

    walk(PisftConfig, "")
    return out


def all_keys() -> list[str]:
    """Every dotted key the schema knows, e.g. `train.micro_batch_size` (no sections)."""
    return [key for key, (section, _) in _schema().items() if not section]


def roles_of(key: str) -> tuple[str, ...]:
    """The marks of a dotted key or a section (`ROLES`); KeyError for a key the schema lacks."""
    return _schema()[key][1]


def keys_marked(role: str) -> tuple[str, ...]:
    """Every key and section marked `role`, in the schema's order (config/config.yaml's)."""
    if role not in ROLES:
        raise ValueError(f"keys_marked: unknown role {role!r}; the roles are {', '.join(ROLES)}")
    return tuple(key for key, (_, roles) in _schema().items() if role in roles)


def fingerprint_keys(run: str) -> tuple[str, ...]:
    """The dotted keys in `run`'s fingerprint (POLICY_RUN or VALUE_RUN): every key marked with it,
    and every key under a section marked with it less those marked INPUT."""
    if run not in (POLICY_RUN, VALUE_RUN):
        raise ValueError(f"fingerprint_keys: {run!r} is not a run fingerprint ({POLICY_RUN}, {VALUE_RUN})")
    schema = _schema()
    sections = [key for key, (section, roles) in schema.items() if section and run in roles]
    return tuple(key for key in all_keys() if run in schema[key][1] or (
        INPUT not in schema[key][1] and any(key.startswith(section + ".") for section in sections)))


def nearest_key(key: str) -> str | None:
    known = all_keys()
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if match:
        return match[0]
    leaf = key.rsplit(".", 1)[-1]
    by_leaf = [k for k in known if k.rsplit(".", 1)[-1] == leaf]
    if by_leaf:
        return by_leaf[0]
    match = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in known], n=1, cutoff=0.6)
    if match:
        return next(k for k in known if k.endswith("." + match[0]) or k == match[0])
    return None


# Keys whose value is a mapping of the user's own keys (checked by the cross-checks).
MAPPING_KEYS = ("data.columns",)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config mapping as dotted keys (`train.lr`); MAPPING_KEYS stay whole values."""
    out: dict[str, Any] = {}
    if isinstance(node, dict):
        for k, v in node.items():
            dotted = f"{prefix}{k}"
            if isinstance(v, dict) and dotted not in MAPPING_KEYS:
                out.update(flatten(v, dotted + "."))
            else:
                out[dotted] = v
    return out


def lookup(config: dict, dotted: str) -> Any:
    """The value of a dotted key (`data.success_only`) or a section (`model`) in a config mapping."""
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node
