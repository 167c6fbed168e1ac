"""The service's one Settings object (pydantic-settings), read from the environment when asked."""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _env(name: str) -> AliasChoices:
    """Accept both NAME and GSPO_NAME, so DATABASE_URL / REDIS_URL / S3_* work as documented."""
    return AliasChoices(name, f"GSPO_{name}")


class Settings(BaseSettings):
    """Service configuration. With nothing set: SQLite + local data dir + a server-less broker."""

    model_config = SettingsConfigDict(env_file=None, extra="ignore", populate_by_name=True)

    data_dir: Path = Field(Path(".data"), validation_alias=_env("DATA_DIR"))
    database_url: str | None = Field(
        None, validation_alias=_env("DATABASE_URL"), description="SQLAlchemy URL; default sqlite:///<data_dir>/gspo.db"
    )
    redis_url: str | None = Field(
        None,
        validation_alias=_env("REDIS_URL"),
        description="Celery broker; default a filesystem broker under data_dir",
    )
    # Object storage: S3 (MinIO, AWS) when S3_BUCKET is set, else <data_dir>/objects.
    s3_bucket: str | None = Field(None, validation_alias=_env("S3_BUCKET"))
    s3_endpoint_url: str | None = Field(None, validation_alias=_env("S3_ENDPOINT_URL"))
    s3_access_key_id: str | None = Field(None, validation_alias=_env("S3_ACCESS_KEY_ID"))
    s3_secret_access_key: str | None = Field(None, validation_alias=_env("S3_SECRET_ACCESS_KEY"))
    s3_region: str = Field("us-east-1", validation_alias=_env("S3_REGION"))
    s3_presign_downloads: bool = Field(True, validation_alias=_env("S3_PRESIGN_DOWNLOADS"))
    # The endpoint users' browsers reach (presigned URLs); default S3_ENDPOINT_URL.
    s3_public_endpoint_url: str | None = Field(None, validation_alias=_env("S3_PUBLIC_ENDPOINT_URL"))

    # Models a job may name: local directories under models_dir, HF ids when allowed.
    models_dir: Path = Field(Path(".data/models"), validation_alias=_env("MODELS_DIR"))
    allow_hub_models: bool = Field(True, validation_alias=_env("ALLOW_HUB_MODELS"))

    # Limits.
    max_upload_bytes: int = Field(64 * 1024 * 1024, validation_alias=_env("MAX_UPLOAD_BYTES"))
    max_file_rows: int = Field(1_000_000, validation_alias=_env("MAX_FILE_ROWS"))
    max_request_bytes: int = Field(1024 * 1024, validation_alias=_env("MAX_REQUEST_BYTES"))
    max_active_jobs_per_tenant: int = Field(16, validation_alias=_env("MAX_ACTIVE_JOBS_PER_TENANT"))

    # Per-tenant API bounds (429 + Retry-After past them). "per tenant" caps are shared by every API
    # process when REDIS_URL is set, else they hold per process; "per process" caps are local.
    max_file_storage_bytes_per_tenant: int = Field(
        100 * 1024**3,  # checkpoints count: one of a 135M model with its optimizer state is 2.2 GB
        validation_alias=_env("MAX_FILE_STORAGE_BYTES_PER_TENANT"),
        description="Sum of a tenant's uploaded files' and checkpoints' sizes (an upload past it is a 413, a job "
        "submitted at it a 409, a checkpoint past it fails its job)",
    )
    max_row_bytes: int = Field(1024 * 1024, validation_alias=_env("MAX_ROW_BYTES"), description="Longest dataset line")
    max_uploads_per_tenant: int = Field(2, validation_alias=_env("MAX_UPLOADS_PER_TENANT"))
    upload_bytes_per_second: float = Field(
        16 * 1024 * 1024,
        ge=0,
        validation_alias=_env("UPLOAD_BYTES_PER_SECOND"),
        description="How fast one upload's body is read (0: unbounded): a tenant's uploads at their cap cost "
        "the API's event loop a bounded share",
    )
    max_uploads_per_process: int = Field(4, validation_alias=_env("MAX_UPLOADS_PER_PROCESS"))
    max_streams_per_tenant: int = Field(8, validation_alias=_env("MAX_STREAMS_PER_TENANT"))
    max_streams_per_process: int = Field(256, validation_alias=_env("MAX_STREAMS_PER_PROCESS"))
    stream_max_seconds: float = Field(
        900.0,
        validation_alias=_env("STREAM_MAX_SECONDS"),
        description="An event stream ends after this; clients resume with Last-Event-ID",
    )
    stream_poll_seconds: float = Field(1.0, validation_alias=_env("STREAM_POLL_SECONDS"))
    max_reward_runs_per_tenant: int = Field(4, ge=1, validation_alias=_env("MAX_REWARD_RUNS_PER_TENANT"))
    max_reward_runs_per_process: int = Field(8, ge=1, validation_alias=_env("MAX_REWARD_RUNS_PER_PROCESS"))
    max_reward_run_samples: int = Field(64, ge=1, le=64, validation_alias=_env("MAX_REWARD_RUN_SAMPLES"))
    reward_run_budget_s: float = Field(
        900.0, validation_alias=_env("REWARD_RUN_BUDGET_S"), description="Grading wall time a tenant may use per window"
    )
    reward_run_window_s: float = Field(3600.0, validation_alias=_env("REWARD_RUN_WINDOW_S"))
    metrics_token: str | None = Field(
        None,
        validation_alias=_env("METRICS_TOKEN"),
        description="Bearer token of GET /metrics; unset: /metrics is off (404)",
    )

    # Graders (see gspo_core.rewards.policy.GraderPolicy): what tenants' graders may do on this host.
    grader_python: str | None = Field(
        None,
        validation_alias=_env("GRADER_PYTHON"),
        description="Interpreter of the grader environment; default the .venv-graders that `make install` built "
        "beside the service's venv, else the service's own interpreter",
    )
    allow_weak_sandbox: bool = Field(
        False,
        validation_alias=_env("ALLOW_WEAK_SANDBOX"),
        description="Accept python graders where the sandbox cannot isolate them",
    )
    sandbox_bwrap: str = Field(
        "bwrap",
        validation_alias=_env("SANDBOX_BWRAP"),
        description="The bubblewrap binary python graders run under (name in PATH or path)",
    )
    grader_max_timeout_s: float = Field(60.0, validation_alias=_env("GRADER_MAX_TIMEOUT_S"))
    grader_max_memory_mb: int = Field(1024, validation_alias=_env("GRADER_MAX_MEMORY_MB"))
    grader_max_concurrency: int = Field(8, ge=1, le=64, validation_alias=_env("GRADER_MAX_CONCURRENCY"))
    sandbox_memory_budget_mb: int = Field(
        4096,
        ge=128,
        validation_alias=_env("SANDBOX_MEMORY_BUDGET_MB"),
        description="Memory all sandboxes of one process may reserve at once",
    )
    egress_allow: str = Field(
        "",
        validation_alias=_env("EGRESS_ALLOW"),
        description="Comma-separated hosts or CIDRs graders' and webhooks' URLs may reach although private",
    )
    grader_local_timeout_s: float = Field(
        5.0,
        gt=0,
        validation_alias=_env("GRADER_LOCAL_TIMEOUT_S"),
        description="Per sample, for graders run in the grader pool",
    )
    grader_local_budget_s: float = Field(
        60.0,
        gt=0,
        validation_alias=_env("GRADER_LOCAL_BUDGET_S"),
        description="Per batch, for graders run in the grader pool",
    )
    grader_pool_size: int = Field(
        0,
        ge=0,
        validation_alias=_env("GRADER_POOL_SIZE"),
        description="Grader pool processes per API/worker process; 0: the CPUs, 2..4",
    )
    dry_run_niceness: int = Field(
        19,
        ge=0,
        le=19,
        validation_alias=_env("DRY_RUN_NICENESS"),
        description="Niceness of the processes the API's dry runs grade in (not the worker's)",
    )
    api_switch_interval_ms: float = Field(
        1.0,
        gt=0,
        le=100,
        validation_alias=_env("API_SWITCH_INTERVAL_MS"),
        description="How long a thread of an API process may hold the GIL while another waits (Python's "
        "default is 5 ms): the event loop waits at most this long behind a busy thread",
    )
    grader_pool_memory_mb: int = Field(
        1024,
        ge=64,
        validation_alias=_env("GRADER_POOL_MEMORY_MB"),
        description="Address space of a grader pool process beyond its start",
    )
    # A job's environment (gspo_core.environments): its generator runs in a grader pool process, this long.
    environment_check_timeout_s: float = Field(
        15.0,
        gt=0,
        le=600,
        validation_alias=_env("ENVIRONMENT_CHECK_TIMEOUT_S"),
        description="Seconds the API gives an environment to generate the items it checks at submission (one "
        "per task, in all) or shows in a preview; past it a 422 naming the task's config",
    )
    environment_generate_timeout_s: float = Field(
        600.0,
        gt=0,
        validation_alias=_env("ENVIRONMENT_GENERATE_TIMEOUT_S"),
        description="Seconds the worker gives an environment to generate a job's items; past it the job fails",
    )
    environment_max_bytes: int = Field(
        1024**3,
        ge=1024,
        validation_alias=_env("ENVIRONMENT_MAX_BYTES"),
        description="Bytes a job's generated items may take as JSONL (each item at most GSPO_MAX_ROW_BYTES)",
    )

    # How this machine runs jobs (see gspo_core.platform.RuntimeOptions): the operator's, never a tenant's.
    rollout_engine: Literal["auto", "vllm", "transformers"] = Field(
        "auto", validation_alias=_env("ROLLOUT_ENGINE"), description="auto = vLLM when installed, else transformers"
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0.0, le=0.95, validation_alias=_env("VLLM_GPU_MEMORY_UTILIZATION")
    )
    keep_freed_memory: bool = Field(
        True,
        validation_alias=_env("KEEP_FREED_MEMORY"),
        description="CPU training: freed memory stays in the job process's heap",
    )
    agent_endpoint_host: str = Field(
        "127.0.0.1",
        max_length=255,
        validation_alias=_env("AGENT_ENDPOINT_HOST"),
        description="Address the chat endpoint of a bring-your-own-agent job listens on (0.0.0.0: every interface)",
    )
    agent_endpoint_port: int = Field(
        0, ge=0, le=65535, validation_alias=_env("AGENT_ENDPOINT_PORT"), description="Its port (0: a free one)"
    )
    agent_endpoint_url: str = Field(
        "",
        max_length=2048,
        pattern=r"^(https?://[^\s/]+(/[^\s]*)?)?$",
        validation_alias=_env("AGENT_ENDPOINT_URL"),
        description="The base URL agents reach it at, e.g. behind a proxy (empty: http://<host>:<port>)",
    )
    # verifiers environments (docs/environments.md): which ones tenants may name, and the venv they run in.
    verifiers_environments: str = Field(
        "",
        max_length=4000,
        validation_alias=_env("VERIFIERS_ENVIRONMENTS"),
        description="Comma-separated ids of the verifiers environments tenants may name (none: the type is refused)",
    )
    envs_python: str | None = Field(
        None,
        validation_alias=_env("ENVS_PYTHON"),
        description="Interpreter of the environments venv (verifiers and the allowed environment packages); "
        "default <checkout>/.venv-envs beside the running venv",
    )
    envs_path: str = Field(
        "",
        max_length=4000,
        validation_alias=_env("ENVS_PATH"),
        description="Colon-separated directories the environment runner also imports environments from",
    )
    rank_timeout_s: int = Field(
        1800,
        ge=5,
        le=86_400,
        validation_alias=_env("RANK_TIMEOUT_S"),
        description="A job on several devices: how long a rank waits in a collective before the attempt is "
        "lost and retried (above the longest rollout phase, which ranks 1..N-1 wait out)",
    )

    log_level: str = Field(
        "WARNING",
        pattern=r"(?i)^(DEBUG|INFO|WARNING|ERROR|CRITICAL)$",
        validation_alias=_env("LOG_LEVEL"),
        description="Level of the logs of `gspo up`, `gspo demo` and their worker, libraries' included "
        "(INFO shows vLLM's, Celery's and the others' progress, as `--verbose` does)",
    )

    # Webhooks (store.webhooks, worker/webhooks.py): sent by every worker's main process.
    max_webhooks_per_tenant: int = Field(10, ge=0, validation_alias=_env("MAX_WEBHOOKS_PER_TENANT"))
    webhook_max_attempts: int = Field(
        8, ge=1, le=100, validation_alias=_env("WEBHOOK_MAX_ATTEMPTS"), description="Attempts per delivery"
    )
    webhook_retry_base_seconds: float = Field(
        30.0,
        gt=0,
        validation_alias=_env("WEBHOOK_RETRY_BASE_SECONDS"),
        description="Wait before the 2nd attempt; doubled before each next one",
    )
    webhook_retry_max_seconds: float = Field(3600.0, gt=0, validation_alias=_env("WEBHOOK_RETRY_MAX_SECONDS"))
    webhook_timeout_seconds: float = Field(10.0, gt=0, le=60, validation_alias=_env("WEBHOOK_TIMEOUT_SECONDS"))
    webhook_poll_seconds: float = Field(
        2.0, gt=0, validation_alias=_env("WEBHOOK_POLL_SECONDS"), description="How often due deliveries are sent"
    )

    # Worker leases and retries.
    lease_seconds: float = Field(30.0, validation_alias=_env("LEASE_SECONDS"))
    heartbeat_seconds: float = Field(5.0, validation_alias=_env("HEARTBEAT_SECONDS"))
    max_attempts: int = Field(3, validation_alias=_env("MAX_ATTEMPTS"))
    reaper_interval_seconds: float = Field(15.0, validation_alias=_env("REAPER_INTERVAL_SECONDS"))
    # A queued job older than this while the broker queue is empty lost its message: send it again.
    resend_lost_after_seconds: float = Field(60.0, validation_alias=_env("RESEND_LOST_AFTER_SECONDS"))
    worker_queue: str = Field("gpu", validation_alias=_env("WORKER_QUEUE"))
    # What `gspo worker` serves: queued jobs (Celery) or Tinker API sessions (worker.sessions).
    worker_mode: Literal["jobs", "sessions"] = Field(
        "jobs", validation_alias=_env("WORKER_MODE"), description="What a worker serves: jobs or sessions"
    )
    # Tinker API sessions (api/routers/tinker.py, worker/sessions.py).
    max_active_sessions_per_tenant: int = Field(
        4, ge=1, validation_alias=_env("MAX_ACTIVE_SESSIONS_PER_TENANT"), description="Open sessions per tenant"
    )
    session_idle_seconds: float = Field(
        300.0,
        gt=0,
        validation_alias=_env("SESSION_IDLE_SECONDS"),
        description="A session with no heartbeat or request for this long is closed and its models released",
    )
    tinker_long_poll_seconds: float = Field(
        10.0,
        gt=0,
        le=40,  # the SDK gives up on a retrieve_future after 45 s
        validation_alias=_env("TINKER_LONG_POLL_SECONDS"),
        description="How long retrieve_future waits for an unfinished request before answering try_again (408)",
    )
    # Devices: what this worker has (it takes only jobs asking for at most as many), and the most a job may ask.
    worker_devices: int = Field(
        1, ge=1, validation_alias=_env("WORKER_DEVICES"), description="Devices (GPUs) this worker runs one job on"
    )
    max_job_devices: int = Field(
        8,
        ge=1,
        validation_alias=_env("MAX_JOB_DEVICES"),
        description="The most devices a job may ask for (resources.devices); the largest worker's count",
    )

    # Scheduling and budgets (store.scheduling, store.usage). A job's device time is the wall time its
    # attempts held a worker, summed over attempts; 0 turns a limit off.
    max_job_wall_seconds: float = Field(
        72 * 3600.0,
        ge=0,
        validation_alias=_env("MAX_JOB_WALL_SECONDS"),
        description="Device time a job may use; a job may ask for less",
    )
    tenant_device_hours_per_period: float = Field(
        0.0,
        ge=0,
        validation_alias=_env("TENANT_DEVICE_HOURS_PER_PERIOD"),
        description="Device hours a tenant's jobs may start within in one budget period; 0 = no budget",
    )
    budget_period_seconds: int = Field(
        86400,
        ge=1,
        validation_alias=_env("BUDGET_PERIOD_SECONDS"),
        description="Length of a budget period, aligned to the Unix epoch (86400: the UTC calendar day)",
    )

    @model_validator(mode="after")
    def _models_under_data_dir(self) -> Settings:
        # An unset models_dir follows data_dir, so GSPO_DATA_DIR alone relocates everything.
        if "models_dir" not in self.model_fields_set:
            self.models_dir = self.data_dir / "models"
        if self.grader_python is None:
            self.grader_python = installed_grader_python()
        if self.envs_python is None:
            self.envs_python = installed_venv_python(".venv-envs")
        return self

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'gspo.db').resolve()}"

    def grader_policy(self) -> dict:
        """The operator's grader rules as plain values (``GraderPolicy.from_mapping`` in api/ and worker/)."""
        return {
            "python": self.grader_python,
            "bwrap": self.sandbox_bwrap,
            "allow_weak_isolation": self.allow_weak_sandbox,
            "max_timeout_s": self.grader_max_timeout_s,
            "max_memory_mb": self.grader_max_memory_mb,
            "max_concurrency": self.grader_max_concurrency,
            "sandbox_memory_budget_mb": self.sandbox_memory_budget_mb,
            "egress_allow": tuple(h.strip() for h in self.egress_allow.split(",") if h.strip()),
            "local_timeout_s": self.grader_local_timeout_s,
            "local_budget_s": self.grader_local_budget_s,
            "pool_size": self.grader_pool_size,
            "pool_memory_mb": self.grader_pool_memory_mb,
        }

    def runtime_options(self) -> dict:
        """How jobs run on this machine, as plain values (``RuntimeOptions.from_mapping`` in the worker)."""
        return {
            "rollout_engine": self.rollout_engine,
            "vllm_gpu_memory_utilization": self.vllm_gpu_memory_utilization,
            "keep_freed_memory": self.keep_freed_memory,
            "agent_endpoint_host": self.agent_endpoint_host,
            "agent_endpoint_port": self.agent_endpoint_port,
            "agent_endpoint_url": self.agent_endpoint_url,
            "rank_timeout_s": self.rank_timeout_s,
            "envs_python": self.envs_python or "",
            "verifiers_environments": self.allowed_verifiers(),
            "envs_path": tuple(d for d in self.envs_path.split(":") if d),
        }

    def allowed_verifiers(self) -> tuple[str, ...]:
        """The verifiers environment ids tenants may name."""
        return tuple(i.strip() for i in self.verifiers_environments.split(",") if i.strip())

    def broker_is_embedded(self) -> bool:
        return not self.redis_url


def installed_venv_python(name: str) -> str | None:
    """The interpreter of the venv ``name`` that the install step built beside the running venv; None outside a
    venv or without one."""
    if sys.prefix == sys.base_prefix:
        return None
    python = Path(sys.prefix).parent / name / "bin" / "python"
    return str(python) if python.exists() else None


def installed_grader_python() -> str | None:
    """The grader environment's interpreter that the install step built beside the running venv
    (``<checkout>/.venv-graders`` next to ``<checkout>/.venv``), so a service started as the README says
    (``.venv/bin/gspo up``) finds it as one started by ``make`` does; None outside a venv or without one."""
    return installed_venv_python(".venv-graders")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Settings from the environment, read once on first use (never at import time)."""
    return Settings()
