"""Settings of the API and of the shared persistence/queue layer.

Built by `build_settings()`, never at import, so tests and the CLI can point a process at another
database or broker through the environment. With no environment at all the service runs on the
embedded default: a SQLite file and a filesystem broker under the data folder.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GRPO_", extra="ignore")

    data_dir: Path = Field(
        default=Path(".grpo"),
        description="Folder for the embedded database, broker queue, checkpoints and the local key.",
    )
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default: SQLite file in data_dir."
    )
    broker_url: str | None = Field(
        default=None, description="Celery broker URL; default: filesystem queue in data_dir."
    )
    redis_url: str | None = Field(
        default=None,
        description="Redis for live metric streams; default: the broker when it is Redis.",
    )
    queue_name: str = Field(default="grpo-jobs", description="Celery queue the jobs go to.")
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, description="Requests with a larger body get 413."
    )
    max_attempts: int = Field(default=3, ge=1, description="Attempts before a job fails.")
    lease_seconds: float = Field(
        default=60.0, gt=0, description="A running job whose heartbeat is older is re-queued."
    )
    heartbeat_seconds: float = Field(default=5.0, gt=0, description="Worker heartbeat period.")
    redispatch_seconds: float = Field(
        default=120.0,
        gt=0,
        description="A queued job whose message is older than this is sent again.",
    )
    idempotency_ttl_hours: float = Field(
        default=24.0, gt=0, description="Idempotency key lifetime."
    )
    sse_heartbeat_seconds: float = Field(
        default=15.0, gt=0, description="Comment line sent on an idle event stream."
    )
    sse_poll_seconds: float = Field(
        default=1.0, gt=0, description="Longest wait between database reads of a live stream."
    )
    checkpoint_dir: Path | None = Field(
        default=None, description="Where workers write checkpoints; default: data_dir/checkpoints."
    )

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'grpo.db').resolve()}"

    @property
    def resolved_broker_url(self) -> str:
        return self.broker_url or "filesystem://"

    @property
    def broker_folder(self) -> Path:
        return (self.data_dir / "broker").resolve()

    @property
    def resolved_redis_url(self) -> str | None:
        if self.redis_url:
            return self.redis_url
        broker = self.resolved_broker_url
        return broker if broker.startswith(("redis://", "rediss://")) else None

    @property
    def resolved_checkpoint_dir(self) -> Path:
        return (self.checkpoint_dir or self.data_dir / "checkpoints").resolve()

    @property
    def uses_embedded_database(self) -> bool:
        return self.resolved_database_url.startswith("sqlite")


def build_settings(**overrides: object) -> Settings:
    """Read settings from the environment (GRPO_*), with explicit overrides winning."""
    settings = Settings(**overrides)  # type: ignore[arg-type]
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return settings
