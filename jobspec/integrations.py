"""The ``integrations`` section of the job spec: experiment trackers a job's run is exported to.

A job names *where* in a tracker its run goes (an MLflow experiment, a W&B project); the
operator decides *which* trackers the service talks to and with which credentials (worker and
API settings, never the job): an MLflow ``tracking_uri`` must be one of the operator's allowed
URIs (checked by the API at submission and by the worker again), and W&B runs go to the W&B
host and account of the workers' environment.

Every field is bounded; the limits are the trackers' own or tighter (MLflow: names 250,
tags 250/5000; W&B: tags 64 characters).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, get_args

from pydantic import Field, field_validator

from specbase import StrictModel, literal_tag

__all__ = [
    "INTEGRATION_TYPES",
    "MAX_INTEGRATIONS",
    "RESERVED_TAG_PREFIXES",
    "IntegrationSpec",
    "IntegrationSpecUnion",
    "MlflowIntegration",
    "WandbIntegration",
    "integration_refusal",
    "normalized_uri",
]

MAX_INTEGRATIONS = 4
MAX_TRACKING_URI_CHARS = 1000
MAX_MLFLOW_TAGS = 32
MAX_WANDB_TAGS = 32

# MLflow tag keys: letters, digits, and _ - . / and spaces (its own rule); W&B names: no / \ # ? % :
_MLFLOW_KEY = re.compile(r"^[\w./\- ]{1,250}$")
_WANDB_NAME = re.compile(r"^[^/\\#?%:\x00-\x1f]{1,128}$")
# The tag keys the service writes itself (job id, checkpoint): a job may not set them.
RESERVED_TAG_PREFIXES = ("grpo.", "mlflow.")


class MlflowIntegration(StrictModel):
    """Export the run to an MLflow tracking server: params (the resolved spec, flattened), every
    step's metrics, and the final checkpoint reference (tag ``grpo.final_checkpoint``)."""

    type: Literal["mlflow"] = Field(description="An MLflow tracking server.")
    experiment: str = Field(
        min_length=1,
        max_length=250,
        description="Experiment name (created when it does not exist).",
    )
    run_name: str | None = Field(
        default=None, min_length=1, max_length=250, description="Run name (default: the job id)."
    )
    tags: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_MLFLOW_TAGS,
        description=f"Run tags (at most {MAX_MLFLOW_TAGS}; keys 250, values 5000 characters).",
    )
    tracking_uri: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TRACKING_URI_CHARS,
        description=(
            "One of the service's allowed tracking servers (GRPO_MLFLOW_TRACKING_URIS); "
            "default: the first of them."
        ),
    )

    @field_validator("tags")
    @classmethod
    def _tags(cls, tags: dict[str, str]) -> dict[str, str]:
        for key, value in tags.items():
            if not _MLFLOW_KEY.match(key):
                raise ValueError(
                    "tag keys are 1 to 250 letters, digits, '_', '-', '.', '/' or spaces; "
                    f"got {key!r:.80}"
                )
            if key.startswith(RESERVED_TAG_PREFIXES):
                raise ValueError(
                    f"tag keys starting with grpo. or mlflow. are the service's: {key!r:.80}"
                )
            if len(value) > 5000:
                raise ValueError(f"tag values are at most 5000 characters ({key!r:.80})")
        return tags

    @field_validator("tracking_uri")
    @classmethod
    def _http_uri(cls, uri: str | None) -> str | None:
        if uri is not None and not re.match(r"^https?://[^\s/?#]+", uri):
            raise ValueError(f"tracking_uri is an http(s) URL; got {uri!r:.120}")
        return uri


class WandbIntegration(StrictModel):
    """Export the run to Weights & Biases: config (the resolved spec, flattened), every step's
    metrics, and the final checkpoint reference (summary ``grpo.final_checkpoint``)."""

    type: Literal["wandb"] = Field(description="Weights & Biases.")
    project: str = Field(min_length=1, max_length=128, description="W&B project name.")
    entity: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="W&B entity (team or user); default: the workers' API key's default entity.",
    )
    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="Run display name (default: job id).",
    )
    tags: list[str] = Field(
        default_factory=list,
        max_length=MAX_WANDB_TAGS,
        description=f"Run tags (at most {MAX_WANDB_TAGS}, each 1 to 64 characters).",
    )

    @field_validator("project", "entity")
    @classmethod
    def _names(cls, value: str | None) -> str | None:
        if value is not None and not _WANDB_NAME.match(value):
            raise ValueError(
                f"W&B project and entity names must not contain / \\ # ? % : ; got {value!r:.80}"
            )
        return value

    @field_validator("tags")
    @classmethod
    def _tags(cls, tags: list[str]) -> list[str]:
        for tag in tags:
            if not 1 <= len(tag) <= 64:
                raise ValueError(f"W&B tags are 1 to 64 characters; got {tag!r:.80}")
        return tags


# The one list of integration classes: a new tracker is a class above plus a member here (and
# its exporter in worker.trackers).
IntegrationSpecUnion = MlflowIntegration | WandbIntegration
IntegrationSpec = Annotated[IntegrationSpecUnion, Field(discriminator="type")]
INTEGRATION_TYPES: tuple[str, ...] = tuple(
    literal_tag(cls) for cls in get_args(IntegrationSpecUnion)
)


def normalized_uri(uri: str) -> str:
    """A tracking URI as compared against the operator's list: no surrounding space, no
    trailing '/'."""
    return uri.strip().rstrip("/")


def integration_refusal(
    integration: IntegrationSpecUnion, *, mlflow_uris: list[str], wandb_enabled: bool
) -> tuple[str, str] | None:
    """Why this deployment refuses ``integration``, as ``(field, message)`` with ``field`` the
    part after ``integrations[i]`` (``""`` or ``".tracking_uri"``), or None when it accepts it.
    The one rule the API (at submission) and the worker (before exporting) both apply."""
    if isinstance(integration, MlflowIntegration):
        if not mlflow_uris:
            return "", "this service exports to no MLflow tracking server"
        uri = integration.tracking_uri
        if uri is not None and normalized_uri(uri) not in mlflow_uris:
            return (
                ".tracking_uri",
                f"tracking_uri {uri!r:.120} is not one of this service's MLflow tracking "
                f"servers ({', '.join(mlflow_uris)}); leave it out for {mlflow_uris[0]}",
            )
        return None
    if not wandb_enabled:
        return "", "this service exports to no Weights & Biases account"
    return None
