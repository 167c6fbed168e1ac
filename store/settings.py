"""The service's one Settings object (pydantic-settings), read from the environment when asked."""

from __future__ import annotations

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
    database_url: str | None = Field(None, validation_alias=_env("DATABASE_URL"),
                                     description="SQLAlchemy URL; default sqlite:///<data_dir>/gspo.db")
    redis_url: str | None = Field(None, validation_alias=_env("REDIS_URL"),
                                  description="Celery broker; default a filesystem broker under data_dir")
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

    # Graders (see gspo_core.rewards.policy.GraderPolicy): what tenants' graders may do on this host.
    grader_python: str | None = Field(None, validation_alias=_env("GRADER_PYTHON"),
                                      description="Interpreter of the grader environment; default the service's")
    allow_weak_sandbox: bool = Field(False, validation_alias=_env("ALLOW_WEAK_SANDBOX"),
                                     description="Accept python graders where the sandbox cannot isolate them")
    grader_max_timeout_s: float = Field(60.0, validation_alias=_env("GRADER_MAX_TIMEOUT_S"))
    grader_max_memory_mb: int = Field(16384, validation_alias=_env("GRADER_MAX_MEMORY_MB"))
    egress_allow: str = Field("", validation_alias=_env("EGRESS_ALLOW"),
                              description="Comma-separated hosts or CIDRs graders' URLs may reach although private")

    # How this machine runs jobs (see gspo_core.platform.RuntimeOptions): the operator's, never a tenant's.
    rollout_engine: Literal["auto", "vllm", "transformers"] = Field(
        "auto", validation_alias=_env("ROLLOUT_ENGINE"), description="auto = vLLM when installed, else transformers")
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0.0, le=0.95,
                                               validation_alias=_env("VLLM_GPU_MEMORY_UTILIZATION"))
    keep_freed_memory: bool = Field(True, validation_alias=_env("KEEP_FREED_MEMORY"),
                                    description="CPU training: freed memory stays in the job process's heap")

    # Worker leases and retries.
    lease_seconds: float = Field(30.0, validation_alias=_env("LEASE_SECONDS"))
    heartbeat_seconds: float = Field(5.0, validation_alias=_env("HEARTBEAT_SECONDS"))
    max_attempts: int = Field(3, validation_alias=_env("MAX_ATTEMPTS"))
    reaper_interval_seconds: float = Field(15.0, validation_alias=_env("REAPER_INTERVAL_SECONDS"))
    # A queued job older than this while the broker queue is empty lost its message: send it again.
    resend_lost_after_seconds: float = Field(60.0, validation_alias=_env("RESEND_LOST_AFTER_SECONDS"))
    worker_queue: str = Field("gpu", validation_alias=_env("WORKER_QUEUE"))

    @model_validator(mode="after")
    def _models_under_data_dir(self) -> "Settings":
        # An unset models_dir follows data_dir, so GSPO_DATA_DIR alone relocates everything.
        if "models_dir" not in self.model_fields_set:
            self.models_dir = self.data_dir / "models"
        return self

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'gspo.db').resolve()}"

    def grader_policy(self) -> dict:
        """The operator's grader rules as plain values (``GraderPolicy.from_mapping`` in api/ and worker/)."""
        return {"python": self.grader_python, "allow_weak_isolation": self.allow_weak_sandbox,
                "max_timeout_s": self.grader_max_timeout_s, "max_memory_mb": self.grader_max_memory_mb,
                "egress_allow": tuple(h.strip() for h in self.egress_allow.split(",") if h.strip())}

    def runtime_options(self) -> dict:
        """How jobs run on this machine, as plain values (``RuntimeOptions.from_mapping`` in the worker)."""
        return {"rollout_engine": self.rollout_engine, "vllm_gpu_memory_utilization": self.vllm_gpu_memory_utilization,
                "keep_freed_memory": self.keep_freed_memory}

    def broker_is_embedded(self) -> bool:
        return not self.redis_url


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Settings from the environment, read once on first use (never at import time)."""
    return Settings()
