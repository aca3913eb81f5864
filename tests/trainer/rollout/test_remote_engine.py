"""The rollout server and its client (issue 36): a remote engine generates what the in-process
engine generates, at the version each call names; weights travel as published files; a killed
server is restarted and the interrupted call retried with the same result; the server's door
is locked (secret, bounded bodies); no server outlives its client.

Tests that start a server are marked ``process`` (a server process, on the tiny model); the
vLLM one is ``model`` too. The version rule and the published files are tested without one."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.conftest import wait_until
from tests.trainer.rollout.conftest import chat_prompts
from trainer.distributed.weights import bucketed
from trainer.models.loading import load_policy
from trainer.rollout.base import Completion
from trainer.rollout.registry import make_engine
from trainer.rollout.remote_engine import RemoteEngine, RolloutServerError
from trainer.rollout.rollout_server import SECRET_HEADER, RolloutServerConfig
from trainer.rollout.rollout_service import RolloutService, VersionUnavailable
from trainer.rollout.vllm_weights import engine_tensors
from trainer.rollout.weight_versions import PublishedVersions, published_buckets, version_folder

QUESTIONS = ["what is 2+3?", "hi", "count: 1, 2, 3"]
MAX_LEN = 256
SAMPLED: dict[str, Any] = {"max_new_tokens": 24, "temperature": 1.0, "seed": 7}
server = pytest.mark.process  # starts a rollout server process


def _config(model_dir: Path, engine: str = "transformers", **extra: Any) -> RolloutServerConfig:
    return RolloutServerConfig(
        engine=engine,
        model_path=str(model_dir),
        tokenizer_path=str(model_dir),
        dtype="float32",
        max_model_len=MAX_LEN,
        threads=1,  # as the test process (OMP_NUM_THREADS=1): same kernels, same numbers
        **extra,
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return load_policy(tiny_model_dir)[1]


@pytest.fixture(scope="module")
def prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    return chat_prompts(tokenizer, QUESTIONS)


@pytest.fixture(scope="module")
def client(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteEngine]:
    # One server for the tests that only call it; each names the version it needs.
    engine = RemoteEngine(
        _config(tiny_model_dir, max_body_bytes=1 << 20), root=tmp_path_factory.mktemp("server")
    )
    yield engine
    engine.close()


@pytest.fixture()
def fresh(tiny_model_dir: Path, tmp_path: Path) -> Iterator[RemoteEngine]:
    """A server of the test's own (it gets killed)."""
    engine = RemoteEngine(_config(tiny_model_dir), root=tmp_path)
    yield engine
    engine.close()


def _perturbed(model_dir: Path, seed: int) -> PreTrainedModel:
    """The tiny model with every weight moved: another policy version."""
    model, _ = load_policy(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model


def _local(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> Any:
    """The in-process transformers engine on ``model``."""
    return make_engine(
        "transformers",
        model_dir,
        tokenizer,
        dtype="float32",
        max_model_len=MAX_LEN,
        policy_model=model,
    )


def _same(groups: list[list[Completion]]) -> list[list[tuple[Any, ...]]]:
    """What must match between engines (not the version, which only the server sets)."""
    return [[(c.token_ids, c.logprobs, c.text, c.finish_reason) for c in g] for g in groups]


def _versions(groups: list[list[Completion]]) -> set[int | None]:
    return {c.policy_version for g in groups for c in g}


def _gone(pid: int) -> bool:
    """The process is dead (a zombie no one reaped counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


# --------------------------------------------------------------------------- (a), (b)


@server
def test_remote_generate_equals_the_in_process_engine(
    client: RemoteEngine, tiny_model_dir: Path, tokenizer, prompts
) -> None:
    local = _local(load_policy(tiny_model_dir)[0], tokenizer, tiny_model_dir)
    for greedy in (False, True):
        remote = client.generate(prompts, 4, **SAMPLED, greedy=greedy, version=0)
        assert _same(remote) == _same(local.generate(prompts, 4, **SAMPLED, greedy=greedy))
        assert _versions(remote) == {0}
    assert client.max_model_len == MAX_LEN
    assert client.health()["threads"] == 1  # the server's own thread count, as configured
    assert client.prefill is None  # the transformers engine has no prefix cache to count


@server
def test_a_published_version_serves_its_weights_and_the_base_stays(
    client: RemoteEngine, tiny_model_dir: Path, tokenizer, prompts
) -> None:
    base = _same(
        _local(load_policy(tiny_model_dir)[0], tokenizer, tiny_model_dir).generate(
            prompts, 4, **SAMPLED
        )
    )
    moved = _perturbed(tiny_model_dir, seed=1)
    expected = _same(_local(moved, tokenizer, tiny_model_dir).generate(prompts, 4, **SAMPLED))
    assert expected != base  # the new weights change what is sampled
    version = client.publish_version
    client.sync_weights(moved)
    assert client.publish_version == version + 1
    # Interleaved callers each get the version they name (the server reloads in between).
    for _ in range(2):
        at_new = client.at_version(version).generate(prompts, 4, **SAMPLED)
        assert _same(at_new) == expected and _versions(at_new) == {version}
        at_base = client.generate(prompts, 4, **SAMPLED, version=0)
        assert _same(at_base) == base and _versions(at_base) == {0}
    assert _versions(client.generate(prompts, 1, **SAMPLED)) == {version}  # None: the newest


@server
def test_streamed_buckets_publish_a_version(
    client: RemoteEngine, tiny_model_dir: Path, tokenizer, prompts
) -> None:
    moved = _perturbed(tiny_model_dir, seed=2)
    version = client.publish_version
    # Small buckets: the version is many files, loaded one at a time by the server.
    client.load_weight_buckets(bucketed(engine_tensors(moved, torch.float32), 1 << 16))
    assert len(list(version_folder(client.versions.folder, version).glob("*.safetensors"))) > 3
    expected = _local(moved, tokenizer, tiny_model_dir).generate(prompts, 2, **SAMPLED)
    assert _same(client.generate(prompts, 2, **SAMPLED, version=version)) == _same(expected)


@server
def test_unpublished_and_forgotten_versions_are_refused(
    client: RemoteEngine, tiny_model_dir: Path, prompts
) -> None:
    with pytest.raises(ValueError, match="not published"):
        client.generate(prompts, 1, **SAMPLED, version=10_000)
    client.sync_weights(_perturbed(tiny_model_dir, seed=3))
    newest = client.publish_version - 1
    client.publish_version = newest  # a version is written once: never again
    with pytest.raises(ValueError, match="not above"):
        client.sync_weights(_perturbed(tiny_model_dir, seed=3))
    client.publish_version = newest + 1
    client.forget_versions_below(newest)
    assert [p.name for p in client.versions.folder.iterdir()] == [f"v{newest}"]
    with pytest.raises(ValueError, match="not published"):
        client.generate(prompts, 1, **SAMPLED, version=0)  # the base went too
    assert _versions(client.generate(prompts, 1, **SAMPLED)) == {newest}


# --------------------------------------------------------------------------- (c) restarts


@server
def test_a_server_killed_between_calls_is_restarted(
    fresh: RemoteEngine, tiny_model_dir: Path, prompts
) -> None:
    fresh.sync_weights(_perturbed(tiny_model_dir, seed=4))
    expected = fresh.generate(prompts, 4, **SAMPLED, version=1)
    first = fresh.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    again = fresh.generate(prompts, 4, **SAMPLED, version=1)  # loaded from the published files
    assert _same(again) == _same(expected) and _versions(again) == {1}
    assert fresh.restarts == 1
    assert fresh.pid != first and _gone(first)


@server
def test_a_server_killed_during_a_call_is_restarted_and_the_call_retried(
    fresh: RemoteEngine, tiny_model_dir: Path, prompts
) -> None:
    fresh.sync_weights(_perturbed(tiny_model_dir, seed=5))
    # A long call (seconds), so the kill lands while the server generates it.
    long: dict[str, Any] = {"max_new_tokens": 200, "temperature": 1.0, "seed": 11, "version": 1}
    expected = fresh.generate(prompts * 3, 8, **long)
    calls = fresh.health()["generate_calls"]
    first = fresh.pid
    assert first is not None
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["groups"] = fresh.generate(prompts * 3, 8, **long)
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=call)
    thread.start()
    wait_until(
        lambda: fresh.health()["generate_calls"] > calls, 30, "the server to receive the call", 0.01
    )
    os.kill(first, signal.SIGKILL)
    thread.join(120)
    assert not thread.is_alive()
    assert "error" not in result, result.get("error")
    assert _same(result["groups"]) == _same(expected) and _versions(result["groups"]) == {1}
    assert fresh.restarts == 1  # 0 would mean the call ended before the kill
    assert _gone(first)


@server
def test_a_server_killed_while_it_starts_is_started_again(
    tiny_model_dir: Path, tmp_path: Path, prompts
) -> None:
    """kill -9 before the server is ready (a fault, not the server's own exit): the client
    starts another (the chaos run found a job failed for good by one such kill)."""
    import psutil

    made: dict[str, Any] = {}
    (tmp_path / "client").mkdir()

    def servers() -> set[int]:
        """This process's rollout servers (the module's shared one among them)."""
        found = set()
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "trainer.rollout.rollout_server" in " ".join(child.cmdline()):
                    found.add(int(child.pid))
        return found

    others = servers()

    def start() -> None:
        try:
            made["engine"] = RemoteEngine(_config(tiny_model_dir), root=tmp_path / "client")
        except BaseException as exc:
            made["error"] = exc

    thread = threading.Thread(target=start)
    thread.start()

    def starting_server() -> int | None:
        return next(iter(servers() - others), None)

    first = wait_until(starting_server, 60, "the new server process to appear", 0.01)
    assert not (tmp_path / "client" / "ready.json").exists()  # killed before it was ready
    os.kill(first, signal.SIGKILL)
    thread.join(120)
    assert "error" not in made, made.get("error")
    engine: RemoteEngine = made["engine"]
    try:
        assert engine.pid != first and _gone(first)
        assert engine.generate(prompts, 2, **SAMPLED)[0][0].token_ids
    finally:
        engine.close()


@server
def test_a_server_that_cannot_start_says_why(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = _config(tiny_model_dir)
    config.model_path = str(tmp_path / "no-such-model")
    with pytest.raises(RolloutServerError, match="exited with code") as caught:
        RemoteEngine(config, root=tmp_path)
    assert "no-such-model" in str(caught.value)  # the server's own error, from its output
    assert not any(tmp_path.glob("rollout-server-*"))  # its folder went with it


# --------------------------------------------------------------------------- (d) the door


def _raw(
    client: RemoteEngine,
    method: str,
    path: str,
    secret: str | None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    server = client._owned.server
    assert server is not None
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.putrequest(method, path)
        for key, value in {
            **({SECRET_HEADER: secret} if secret is not None else {}),
            **(headers or {}),
        }.items():
            conn.putheader(key, value)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


@server
def test_the_server_wants_its_secret_and_bounds_bodies(client: RemoteEngine) -> None:
    server = client._owned.server
    assert server is not None
    assert _raw(client, "GET", "/health", server.secret)[0] == 200
    assert _raw(client, "GET", "/health", "wrong")[0] == 401
    assert _raw(client, "GET", "/health", None)[0] == 401
    assert _raw(client, "POST", "/generate", "wrong", {"Content-Length": "10"})[0] == 401
    assert _raw(client, "POST", "/generate", server.secret, {"Content-Length": "-1"})[0] == 411
    limit = client.config.max_body_bytes
    # Refused from its declared length, unread (no body needs to be sent).
    status, answer = _raw(
        client, "POST", "/generate", server.secret, {"Content-Length": str(limit + 1)}
    )
    assert status == 413 and str(limit) in answer["error"]
    # The client refuses to send one (the server would reset the connection), no restart.
    restarts = client.restarts
    with pytest.raises(ValueError, match="max_body_bytes"):
        client.generate([[5] * 100] * (limit // 200), 1, **SAMPLED)
    assert client.restarts == restarts


# --------------------------------------------------------------------------- (e) no process left


@server
def test_close_leaves_no_process_and_no_files(
    tiny_model_dir: Path, tmp_path: Path, prompts
) -> None:
    engine = RemoteEngine(_config(tiny_model_dir), root=tmp_path)
    pid, folder = engine.pid, engine.folder
    assert pid is not None and not _gone(pid) and folder.is_dir()
    engine.close()
    assert _gone(pid) and not folder.exists()
    with pytest.raises(RolloutServerError, match="closed"):
        engine.generate(prompts, 1, **SAMPLED)
    engine.close()  # twice is harmless


TRAINER = """
import json, sys
from trainer.rollout.remote_engine import RemoteEngine
from trainer.rollout.rollout_server import RolloutServerConfig
engine = RemoteEngine(RolloutServerConfig(**json.loads(sys.argv[1])), root=sys.argv[2])
print(engine.pid, flush=True)
sys.stdin.read()
"""


@server
def test_the_server_exits_when_its_trainer_is_killed(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = json.dumps(json.loads(_config(tiny_model_dir).to_json()))
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, config, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None
        pid = int(trainer.stdout.readline())
        assert not _gone(pid)
        folders = list(tmp_path.glob("rollout-server-*"))
        assert len(folders) == 1 and (folders[0] / "versions").is_dir()
        trainer.kill()  # no close, no atexit: the server must notice by itself
        trainer.wait(30)
        wait_until(lambda: _gone(pid), 30, "the orphaned server to exit", 0.1)
        # ... and take the dead client's folder (its weight versions) with it.
        assert not folders[0].exists()
    finally:
        trainer.kill()
        trainer.wait(30)


# --------------------------------------------------------------------------- vLLM


@server
@pytest.mark.model
def test_a_vllm_server_equals_the_in_process_vllm_engine(
    tiny_model_dir: Path, tmp_path: Path, tokenizer, prompts
) -> None:
    pytest.importorskip("vllm")
    kv = 64 << 20
    remote = RemoteEngine(_config(tiny_model_dir, "vllm", kv_cache_bytes=kv), root=tmp_path)
    local = make_engine(
        "vllm", tiny_model_dir, tokenizer, dtype="float32", max_model_len=MAX_LEN, kv_cache_bytes=kv
    )
    try:
        base = local.generate(prompts, 4, **SAMPLED)
        assert _same(remote.generate(prompts, 4, **SAMPLED, version=0)) == _same(base)
        moved = _perturbed(tiny_model_dir, seed=6)
        remote.sync_weights(moved)
        local.sync_weights(moved)
        expected = _same(local.generate(prompts, 4, **SAMPLED))
        assert expected != _same(base)
        assert _same(remote.generate(prompts, 4, **SAMPLED, version=1)) == expected
        # Back to the folder's weights (a tied head: its lm_head is pushed too).
        assert _same(remote.generate(prompts, 4, **SAMPLED, version=0)) == _same(base)
        assert remote.prefill is not None and remote.prefill.prompt_tokens > 0
    finally:
        remote.close()
        local.close()


# --------------------------------------------------------------------------- no process


class _Recording:
    """An engine that records the weights it is given."""

    max_model_len = MAX_LEN

    def __init__(self) -> None:
        self.loads: list[tuple[dict[str, torch.Tensor], Any]] = []

    def generate(self, prompts: list[list[int]], n: int, **_: Any) -> list[list[Completion]]:
        return [[Completion([1], [-0.5], "a", "stop")] * n for _ in prompts]

    def load_weight_buckets(self, buckets: Any, adapter_config: Any = None) -> float:
        self.loads.append(({k: v for b in buckets for k, v in b}, adapter_config))
        return 0.0

    def sync_weights(self, model: Any) -> float:
        return 0.0

    def close(self) -> None:
        pass


def _call(service: RolloutService, version: int) -> dict[str, Any]:
    body = {"prompts": [[1, 2]], "n": 2, "max_new_tokens": 4, "temperature": 1.0, "seed": 0}
    return service.generate({**body, "version": version})


def test_the_version_rule_loads_published_files_once(tmp_path: Path) -> None:
    versions = PublishedVersions(tmp_path, base_version=0, adapters=False, publish_version=0)
    engine = _Recording()
    config = RolloutServerConfig(
        "transformers", "m", "m", "float32", MAX_LEN, weights_dir=str(tmp_path)
    )
    service = RolloutService(config, engine)
    assert _call(service, 0)["policy_version"] == 0 and engine.loads == []  # the folder's
    embed = torch.arange(6.0).reshape(2, 3)
    # A tied head is the same tensor under two names: written twice, read back equal.
    versions.publish([[("embed.weight", embed), ("lm_head.weight", embed)]], None)
    answer = _call(service, 0)  # published files of the base version win over the folder
    assert answer["completions"][0][1]["policy_version"] == 0
    assert len(engine.loads) == 1 and engine.loads[0][1] is None
    assert torch.equal(engine.loads[0][0]["lm_head.weight"], embed)
    _call(service, 0)
    assert len(engine.loads) == 1  # held: not loaded again
    with pytest.raises(VersionUnavailable):
        _call(service, 5)


def test_an_adapter_version_carries_its_peft_config(tmp_path: Path) -> None:
    versions = PublishedVersions(tmp_path, base_version=0, adapters=True, publish_version=3)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="adapter"):
        versions.publish([[(name, torch.ones(4, 8))]], None)
    assert versions.publish([[(name, torch.ones(4, 8))]], lora) == 3
    (bucket,) = [dict(b) for b in published_buckets(version_folder(tmp_path, 3))]
    assert bucket[name].shape == (4, 8)
    engine = _Recording()
    config = RolloutServerConfig(
        "vllm", "m", "m", "float32", MAX_LEN, lora_rank=4, weights_dir=str(tmp_path)
    )
    service = RolloutService(config, engine)
    _call(service, 3)
    ((tensors, loaded_config),) = engine.loads
    assert list(tensors) == [name] and loaded_config.r == 4
    assert versions.resolve(None) == 3 and versions.resolve(0) == 0
    versions.forget_below(3)
    with pytest.raises(ValueError, match="not published"):
        versions.resolve(0)
