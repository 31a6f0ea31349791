"""The rollout engine's settings: one object for what is rolled out and how, built from the
config by the stage that runs it (`Settings.for_evaluation`: eval.*; `Settings.for_collection`:
recap.* for what is rolled out, eval.* for how), and the number of environment processes."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pisft import config as config_mod
from pisft import device as device_mod
from pisft.errors import PisftError
from pisft.policy.rtc import RtcSettings
from pisft.rollout import libero_sim


@dataclass(frozen=True)
class Settings:
    suites: tuple[str, ...]
    trials_per_task: int
    replan_steps: int
    num_wait_steps: int
    seed: int
    resize_size: int
    max_steps: int = 0  # 0: openpi's limit of each suite (libero_sim.SUITE_MAX_STEPS)
    task_ids: tuple[int, ...] = ()  # empty: every task of each suite
    num_envs: int = 1
    videos: bool = True
    # Initial state of each task's first trial (trial i starts from state first_init_state + i):
    # 0 for the evaluation; the RECAP rollout collection starts after the evaluation's states.
    first_init_state: int = 0
    # The rows of every policy forward: up to this many waiting requests share one, padded to it
    # when fewer wait (`forward_rows`; pisft.policy.fixed_shape: a forward's rounding depends on its
    # rows, never on which requests fill them, so results depend on this and not on timing).
    policy_batch: int = 2
    # A batch that could still grow waits at most this long for the environments still simulating.
    policy_batch_wait_ms: float = 0.0
    # The inference delay in control steps (eval.rtc.delay_steps; pisft.rollout.chunking) and
    # real-time chunking's settings (eval.rtc's guidance keys, pisft.policy.rtc), None without RTC.
    delay_steps: int = 0
    rtc: RtcSettings | None = None

    def __post_init__(self) -> None:
        if self.rtc is not None and not isinstance(self.rtc, RtcSettings):
            raise TypeError(f"Settings.rtc: an RtcSettings or None (no real-time chunking), got {self.rtc!r}")

    @classmethod
    def for_evaluation(cls, cfg: config_mod.PisftConfig, stage: str | None = None) -> Settings:
        e = cfg.eval
        return cls(suites=tuple(e.libero_suites), trials_per_task=e.trials_per_task,
                   replan_steps=e.replan_steps, num_wait_steps=e.num_wait_steps,
                   seed=e.closed_loop_seed, resize_size=e.resize_size, max_steps=e.max_steps,
                   task_ids=tuple(e.task_ids), num_envs=resolve_num_envs(e.num_envs, stage=stage),
                   videos=e.videos, policy_batch=e.policy_batch,
                   policy_batch_wait_ms=e.policy_batch_wait_ms, delay_steps=e.rtc.delay_steps,
                   rtc=RtcSettings.from_config(e.rtc) if e.rtc.enabled else None)

    def steps_for(self, suite: str) -> int:
        return self.max_steps or libero_sim.SUITE_MAX_STEPS[suite]

    def forward_rows(self, episodes: int) -> int:
        """The rows of every policy forward for a plan of `episodes`: `policy_batch`, at most one
        per episode (no more requests can ever wait at once). Fixed by the config, so by neither the
        environment processes nor the timing."""
        return max(1, min(self.policy_batch, episodes))

    # How a run goes, not what it gives: the results do not depend on these.
    RUN_ONLY = ("num_envs", "policy_batch_wait_ms")

    def record(self) -> dict:
        """The settings that decide the results (an output's deterministic record; `RUN_ONLY`
        go to the run's timing record). `rtc`: whether real-time chunking is on (its settings are
        the policy's record, `pisft.policy.replicas.policy_record`)."""
        return {**{k: v for k, v in asdict(self).items() if k not in self.RUN_ONLY}, "rtc": self.rtc is not None}

    # the evaluation's settings (kept under the name the stages used)
    from_config = for_evaluation

    @classmethod
    def for_collection(cls, cfg: config_mod.PisftConfig, stage: str | None = None) -> Settings:
        """The RECAP collection's: recap.* for what is rolled out, eval.* for how (openpi's loop,
        the policy's batching), the initial states after the evaluation's, no videos."""
        r, e = cfg.recap, cfg.eval
        return cls(suites=(r.suite,), trials_per_task=r.episodes_per_task, replan_steps=e.replan_steps,
                   num_wait_steps=e.num_wait_steps, seed=r.collect_seed, resize_size=e.resize_size,
                   max_steps=r.max_steps, task_ids=tuple(r.task_ids),
                   num_envs=resolve_num_envs(e.num_envs, stage=stage), videos=False,
                   first_init_state=e.trials_per_task, policy_batch=e.policy_batch,
                   policy_batch_wait_ms=e.policy_batch_wait_ms)


# Memory one LIBERO environment process may take: one peaked at 3.2 GB (issue 22; MuJoCo, both
# cameras' render buffers, robosuite's imports), with a margin.
ENV_MEMORY_BYTES = int(3.5 * (1 << 30))


def auto_num_envs(cores: int | None = None, available: int | None = None) -> tuple[int, str]:
    """`eval.num_envs: 0`: one environment per available core, as many as the memory available
    now holds at `ENV_MEMORY_BYTES` each (at least one); (the number, a sentence saying why)."""
    cores = device_mod.usable_cores() if cores is None else cores
    available = device_mod.available_memory() if available is None else available
    gib = 1 << 30
    if available is None:
        return cores, f"{cores} (one per available core; the available memory is unknown)"
    fit = max(1, available // ENV_MEMORY_BYTES)
    n = min(cores, fit)
    why = (f"{n} ({cores} available cores, {available / gib:.1f} GiB of memory available, about "
           f"{ENV_MEMORY_BYTES / gib:.1f} GiB per LIBERO environment process")
    if fit < cores:
        why += f"; the memory holds {fit}"
    if available < ENV_MEMORY_BYTES:
        why += ", less than one environment needs: it may run out of memory"
    return n, why + "; set eval.num_envs to choose)"


def resolve_num_envs(num_envs: int, *, stage: str | None = None) -> int:
    """`eval.num_envs`: a positive number as given; 0 picks `auto_num_envs` and, with `stage`,
    says what it picked and why."""
    if num_envs < 0:
        raise PisftError(f"eval.num_envs: must be 0 (one per available core that memory allows) or a "
                         f"positive number of environment processes, got {num_envs}")
    if num_envs:
        return num_envs
    n, why = auto_num_envs()
    if stage:
        print(f"{stage}: eval.num_envs 0 -> {why}", flush=True)
    return n

