"""docker-compose.yml and docker/: no engine runs here, so check what a reviewer would check."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def compose() -> dict:  # type: ignore[type-arg]
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


def test_compose_has_the_production_services_with_health_checks() -> None:
    services = compose()["services"]
    assert {"postgres", "redis", "migrate", "api", "worker-gpu", "worker-cpu"} <= set(services)
    for name in ("postgres", "redis", "api"):
        assert "healthcheck" in services[name], name
    assert services["migrate"]["command"] == ["grpo", "db", "upgrade"]
    assert services["api"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    gpu = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert services["worker-cpu"]["profiles"] == ["cpu"]


def test_every_referenced_dockerfile_exists_and_the_api_image_has_no_torch() -> None:
    for name, service in compose()["services"].items():
        build = service.get("build")
        if build:
            assert (ROOT / build["context"] / build["dockerfile"]).is_file(), name
    api = (ROOT / "docker" / "api.Dockerfile").read_text()
    assert '".[api]"' in api
    installs = [line for line in api.splitlines() if "pip install" in line]
    assert installs and all("torch" not in line and "[cpu]" not in line for line in installs)
    assert "'torch' not in sys.modules" in api  # the build itself proves it
    for copied in ("app", "grpo_cli", "migrations", "trainer/config.py"):
        assert copied in api
