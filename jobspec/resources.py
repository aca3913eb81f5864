"""What a job asks of the hardware: how many devices of one machine it trains on."""

from __future__ import annotations

from pydantic import Field

from specbase import StrictModel

MAX_DEVICES = 64  # the spec's own bound; the operator's GRPO_MAX_DEVICES_PER_JOB is lower


class ResourcesSpec(StrictModel):
    """The devices one job trains on: N ranks on one machine, data-parallel (docs/scaling.md)."""

    devices: int = Field(
        default=1,
        ge=1,
        le=MAX_DEVICES,
        description=(
            "Devices of one machine the job trains on (one rank each, the policy sharded "
            "across them, each rank generating its share of the prompts). A job runs only on "
            "a worker with exactly this many devices."
        ),
    )
