"""The operator's settings of the python-grader sandbox (``GRPO_SANDBOX_*``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["SandboxSettings", "build_sandbox_settings", "default_python"]


def default_python() -> str:
    """The system interpreter the sandbox runs (only its standard library is used): Debian's
    /usr/bin/python3, or /usr/local/bin/python3 in python images. Never the worker's virtual
    environment, whose packages and paths the grader has no business seeing."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if Path(candidate).is_file():
            return candidate
    return "python3"


class SandboxSettings(BaseSettings):
    """Limits and switches of python graders; every one bounded."""

    model_config = SettingsConfigDict(env_prefix="GRPO_SANDBOX_", extra="ignore")

    enabled: bool = Field(default=True, description="Run python graders at all.")
    bwrap: str = Field(default="bwrap", description="The bubblewrap executable.")
    python: str = Field(default_factory=default_python, description="Interpreter inside.")
    processes: int = Field(default=2, ge=1, le=64, description="Sandboxes kept per grader.")
    call_timeout_s: float = Field(default=5.0, gt=0, le=600, description="Wall time per call.")
    cpu_s: float = Field(default=5.0, gt=0, le=600, description="CPU time per call.")
    memory_mb: int = Field(default=1024, ge=64, le=65536, description="Address space.")
    max_processes: int = Field(
        default=32, ge=4, le=4096, description="Processes of the sandbox user, all sandboxes."
    )
    file_mb: int = Field(default=16, ge=1, le=4096, description="Largest file a grader writes.")
    tmp_mb: int = Field(default=64, ge=1, le=65536, description="Size of its private /tmp.")
    max_output_bytes: int = Field(
        default=1 << 20, ge=1024, le=1 << 30, description="Longest reply read from a sandbox."
    )
    seccomp: bool = Field(
        default=True, description="Install the seccomp filter (libseccomp) in every sandbox."
    )
    uid: int = Field(default=65534, ge=1, le=2**31 - 1, description="Unprivileged user to run as.")
    startup_timeout_s: float = Field(
        default=20.0, gt=0, le=600, description="Longest a sandbox may take to start."
    )
    # Capacity (grading.sandbox.capacity): the processes above are shared by every sandbox of
    # the host, so how many run at once is bounded, per process and per project.
    max_sandboxes: int = Field(
        default=4,
        ge=1,
        le=256,
        description=(
            "Sandboxes one process (an API process, a worker) runs at once, all graders and "
            "projects together; as many more may wait for one."
        ),
    )
    max_sandboxes_per_project: int = Field(
        default=2,
        ge=1,
        le=256,
        description=(
            "Of those, the most one project's requests hold at once in an API process; as "
            "many more of its requests may wait, the rest get 429 at once."
        ),
    )
    queue_timeout_s: float = Field(
        default=5.0,
        ge=0,
        le=600,
        description="Longest a request waits for a free sandbox, then 429 (its project's cap) or 503.",
    )

    def resolved_bwrap(self) -> str | None:
        return shutil.which(self.bwrap)


def build_sandbox_settings(**overrides: object) -> SandboxSettings:
    """The sandbox settings from the environment, with ``overrides`` on top (tests)."""
    return SandboxSettings(**overrides)  # type: ignore[arg-type]
