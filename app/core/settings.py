"""Settings of the API and of the shared persistence/queue layer.

Built by `build_settings()`, never at import, so tests and the CLI can point a process at another
database or broker through the environment. With no environment at all the service runs on the
embedded default: a SQLite file and a filesystem broker under the data folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from app.core.gateway_settings import GatewaySettings
from app.core.size_class_settings import SizeClassSettings
from app.core.tinker_settings import TinkerSettings
from jobspec.integrations import IntegrationSpecUnion, integration_refusal, normalized_uri
from jobspec.paths import hub_allowlist, hub_model_refusal
from jobspec.resources import MAX_DEVICES


class Settings(GatewaySettings, TinkerSettings, SizeClassSettings):
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
    queue_name: str = Field(
        default="grpo-jobs",
        description=(
            "Celery queue of one-device jobs; a job of N > 1 devices goes to `<queue>-<N>dev` "
            "(app.core.queue.queue_for), the queue its workers of N devices consume."
        ),
    )
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
    delete_grace_seconds: float = Field(
        default=86_400.0,
        ge=0,
        le=10 * 365 * 86_400,
        description=(
            "How long after DELETE /v1/jobs/{id} the workers' maintenance pass purges the job's "
            "checkpoints (from disk) and its samples, metrics and events; the job is hidden at "
            "once. Set it on the API (which reports it) and on the workers (which purge)."
        ),
    )

    # ---- operator limits on what one job may ask for (each refusal is a 422 naming the field)
    max_completions_per_step: int = Field(
        default=4096, ge=1, description="Most completions per step (prompts_per_step x group_size)."
    )
    max_tokens_per_step: int = Field(
        default=4_000_000,
        ge=1,
        description="Most tokens per step: completions x (max_prompt_tokens + max_new_tokens).",
    )
    max_total_tokens: int = Field(
        default=10**11, ge=1, description="Most tokens over a whole job (per step x steps x mu)."
    )
    max_devices_per_job: int = Field(
        default=8,
        ge=1,
        le=MAX_DEVICES,
        description=(
            "Most devices one job may ask for (resources.devices; 422 beyond). A job waits in "
            "the queue of its size class until a worker with exactly that many devices "
            "(GRPO_WORKER_DEVICES) takes it: keep this at the largest worker you run."
        ),
    )
    model_roots: str = Field(
        default="",
        description=(
            "Folders (separated by ':') under which a job's `model` may name a Hugging Face "
            "model folder; empty: packaged models only. Mount them on the API too (read-only is "
            "enough): it checks the folder at submission, the worker again before loading."
        ),
    )
    dataset_roots: str = Field(
        default="",
        description=(
            "Folders (separated by ':') under which a job's dataset.saved_dataset.path may "
            "name a datasets folder (save_to_disk); empty: none. Mount them on the API too."
        ),
    )
    allow_hub_datasets: bool = Field(
        default=True,
        description=(
            "Whether dataset.saved_dataset.hub_id may name a Hub dataset repo, read from the "
            "workers' Hugging Face cache. Set it on the API and the workers: both check."
        ),
    )
    allow_hub_models: bool = Field(
        default=True,
        description=(
            "Whether a job's `model` may be a Hugging Face Hub repo id (owner/name), read "
            "through the worker's Hugging Face cache (HF_HOME)."
        ),
    )
    hub_model_allowlist: str = Field(
        default="",
        description=(
            "Hub models a job may name, separated by commas: owners (`Qwen`) or glob patterns "
            "of repo ids (`Qwen/Qwen2.5-*`), ignoring case; empty: any repo id."
        ),
    )

    # ---- the OpenAI-compatible fine-tuning API (docs/openai-compat.md)
    openai_models: dict[str, str] = Field(
        default_factory=lambda: {
            "o4-mini": "smollm2-135m-instruct",
            "o4-mini-2025-04-16": "smollm2-135m-instruct",
        },
        description=(
            "JSON: OpenAI model names a /v1/fine_tuning job may give -> the model it trains "
            "here (any `model` a native job may name). Names not listed are taken as native "
            "model names."
        ),
    )
    # ---- webhooks (API and workers both check the URL rule)
    webhook_allow_private: bool = Field(
        default=False,
        description=(
            "Whether webhook URLs may point at private, loopback, link-local or reserved "
            "addresses (or names resolving to them). Off: refused when an endpoint is created "
            "and again, after a fresh DNS lookup, before every delivery. Set it on the API and "
            "the workers."
        ),
    )
    max_webhooks_per_project: int = Field(
        default=10, ge=1, le=1000, description="Webhook endpoints a project may hold (422 beyond)."
    )
    # ---- experiment trackers a job's `integrations` may export to (set on the API and workers)
    mlflow_tracking_uris: str = Field(
        default="",
        description=(
            "MLflow tracking servers (http(s) URLs, separated by commas) a job's mlflow "
            "integration may export to; the first is the default. Empty: no MLflow export."
        ),
    )
    wandb_mode: Literal["disabled", "online", "offline"] = Field(
        default="disabled",
        description=(
            "Weights & Biases export: online (to the workers' W&B host and API key), offline "
            "(run files under the workers' data folder, for `wandb sync`), or disabled."
        ),
    )

    # ---- the dashboard's sign-in (app.sessions.routes)
    session_secret: str | None = Field(
        default=None,
        min_length=32,
        description=(
            "Secret that signs the dashboard's session cookies (32+ characters). Unset: a "
            "random one kept in session_secret_file, created on first start. Set it when API "
            "processes do not share that file; changing it signs everybody out."
        ),
    )
    session_secret_file: Path | None = Field(
        default=None,
        description=(
            "Where the generated session secret is kept (created 0600 on first start); "
            "default: data_dir/session-secret. For an API whose data folder is read-only."
        ),
    )
    session_ttl_hours: float = Field(
        default=12.0,
        gt=0,
        le=24 * 30,
        description="How long a dashboard sign-in lasts; then the key is asked for again.",
    )
    session_cookie_secure: bool | None = Field(
        default=None,
        description=(
            "Mark the session cookie Secure (sent over https only). Unset: when the sign-in "
            "request came over https (behind a TLS proxy, run uvicorn with --proxy-headers)."
        ),
    )
    # ---- fair use: one tenant must never starve another
    rate_limit_per_minute: int = Field(
        default=600, ge=1, description="Requests per API key per minute (429 beyond)."
    )
    rate_limit_burst: int = Field(
        default=60, ge=1, description="Requests an idle key may send at once."
    )
    max_active_jobs_per_project: int = Field(
        default=50, ge=1, description="Queued plus running jobs a project may hold (429 beyond)."
    )
    max_active_devices_per_project: int = Field(
        default=64,
        ge=1,
        description=(
            "Devices (resources.devices, summed) a project's queued and running jobs may hold "
            "(429 beyond). At least max_active_jobs_per_project by default, so a project of "
            "one-device jobs meets the job limit first."
        ),
    )
    max_checkpoint_bytes_per_project: int = Field(
        default=50 * 1024**3,
        ge=0,
        description=(
            "Bytes of checkpoints one project may store (its kept checkpoints, deleted jobs' "
            "too until they are purged). A save that would go beyond it is not kept and fails "
            "its job (checkpoint_quota_exceeded). 0: no limit. Set it on the API (GET "
            "/v1/usage reports it) and on the workers (which enforce it)."
        ),
    )
    max_dispatched_per_project: int = Field(
        default=2,
        ge=1,
        description=(
            "Jobs of one project handed to workers at once; the rest wait in the database and "
            "are dispatched round-robin across projects as slots free."
        ),
    )
    max_streams_per_key: int = Field(
        default=5, ge=1, description="Open event streams per API key (429 beyond)."
    )
    max_streams_per_process: int = Field(
        default=200, ge=1, description="Open event streams per API process (429 beyond)."
    )
    max_concurrent_uploads: int = Field(
        default=2,
        ge=1,
        le=64,
        description=(
            "Dataset uploads one API process decodes at once; each may take the dataset "
            "memory budget (256 MiB) besides its body, so this bounds the process (503 beyond)."
        ),
    )
    max_concurrent_uploads_per_project: int = Field(
        default=1, ge=1, le=64, description="Of those, uploads of one project (429 beyond)."
    )
    upload_queue_timeout_s: float = Field(
        default=10.0,
        ge=0,
        le=600,
        description="Longest an upload waits for a decoding slot before its 429 or 503.",
    )
    # ---- the inference gateway's bounds on what one tenant makes the shared engines do
    # (app.gateway; the rest of its settings are app.core.gateway_settings)
    inference_max_tokens_in_flight_per_project: int = Field(
        default=32_768,
        ge=1,
        le=100_000_000,
        description=(
            "Work one project's chat and completion requests in flight may ask of the engines "
            "together: each counts its choices x max_tokens (GRPO_INFERENCE_MAX_TOKENS when "
            "left out of a chat; 16 for a completion, as OpenAI) plus its prompt's characters "
            "(a token id counts one). Beyond, 429 with Retry-After; a request alone is always "
            "admitted, whatever its size."
        ),
    )
    inference_max_response_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=64 * 1024,
        le=1024**3,
        description=(
            "Largest non-streamed chat or completion answer the API passes on; a larger one "
            "is a 400 `response_too_large` (ask for fewer choices, tokens or logprobs, or "
            "stream it: a stream is passed on event by event) and its tokens are charged."
        ),
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
    def resolved_session_secret_file(self) -> Path:
        return self.session_secret_file or self.data_dir / "session-secret"

    @property
    def resolved_model_roots(self) -> list[Path]:
        """The allowed model folders, resolved (symlinks followed) so escapes can be checked."""
        return [Path(p).expanduser().resolve() for p in self.model_roots.split(":") if p.strip()]

    @property
    def model_root_list(self) -> list[str]:
        """The model roots as written (the API and the worker resolve them as they check)."""
        return [p.strip() for p in self.model_roots.split(":") if p.strip()]

    @property
    def dataset_root_list(self) -> list[str]:
        """The dataset roots as written (the API and the worker resolve them as they check)."""
        return [p.strip() for p in self.dataset_roots.split(":") if p.strip()]

    def hub_model_refusal(self, repo_id: str) -> str | None:
        """Why this deployment refuses the Hub repo id `repo_id`, or None (the one rule, in
        jobspec.paths, that the API and the worker both apply)."""
        return hub_model_refusal(
            repo_id,
            allow_hub=self.allow_hub_models,
            allowlist=hub_allowlist(self.hub_model_allowlist),
            has_roots=bool(self.model_root_list),
        )

    @property
    def mlflow_tracking_uri_list(self) -> list[str]:
        """The allowed MLflow tracking servers, normalized (the first is the default)."""
        return [normalized_uri(u) for u in self.mlflow_tracking_uris.split(",") if u.strip()]

    def integration_refusal(self, integration: IntegrationSpecUnion) -> tuple[str, str] | None:
        """Why this deployment refuses a job's tracker `integration` (see
        jobspec.integrations.integration_refusal), or None."""
        return integration_refusal(
            integration,
            mlflow_uris=self.mlflow_tracking_uri_list,
            wandb_enabled=self.wandb_mode != "disabled",
        )

    @property
    def uses_embedded_database(self) -> bool:
        return self.resolved_database_url.startswith("sqlite")


def build_settings(**overrides: object) -> Settings:
    """Read settings from the environment (GRPO_*), with explicit overrides winning."""
    settings = Settings(**overrides)  # type: ignore[arg-type]
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return settings
