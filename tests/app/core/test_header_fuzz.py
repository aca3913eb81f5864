"""Fuzzing of the request headers the API reads itself, which the schema-driven suite
(test_openapi_fuzz.py) leaves alone: Last-Event-ID on a job's event stream, Idempotency-Key on
both create routes, and the dashboard's session cookie. (Multipart uploads: test_upload_fuzz.py.)

Hypothesis generates hostile values: huge and negative numbers, other scripts' digits, control
characters, Latin-1 and UTF-8 bytes, blank and overlong values; keys reused with other bodies
and on the other route; cookies malformed, huge, tampered with, forged and by the dozen. They
go in as raw bytes (tests/app/fuzz_target.py), so the app sees what a server would pass it.
Every answer must be below 500, a status the published schema documents for the operation and,
when an error, the service's one error shape. The status each value is owed is checked too: a
cursor this stream could have sent is accepted and nothing else is; a key's first use creates,
a retry replays and another body is refused; a valid session token signs in."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from starlette.requests import cookie_parser

from app.core.ids import MAX_ID, MAX_STEP
from app.sessions.deps import CSRF_HEADER, SESSION_COOKIE
from tests.app.fuzz_target import Headers, Target
from tests.conftest import new_project_key, tiny_spec

FUZZ = settings(
    deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)


def error_of(response: Any) -> dict[str, Any]:
    body: dict[str, Any] = response.json()["error"]
    return body


@pytest.fixture
def target(fuzz_target: Target) -> Target:
    return fuzz_target


# ---- Last-Event-ID --------------------------------------------------------------------------

STREAM = "/v1/jobs/{job_id}/stream"
ODD_NUMBERS = (
    *("", "0", "00", "+1", "-0", "1_0", "1e3", "0x1f", " 1", "1 ", "1\t", "01", "1\r\n"),
    *("\u00b2", "\u0663", "\uff11", "\u221e", "NaN", "\U0001d7d9", "1\u0300", "\x00"),
    *(str(MAX_ID), str(MAX_ID + 1), str(MAX_STEP), str(MAX_STEP + 1)),
    *("0" * 19 + "1", "9" * 40, "1" * 70),
)
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str), st.sampled_from(ODD_NUMBERS)
)
cursors = st.one_of(
    st.builds(lambda a, sep, b: a + sep + b, numbers, st.sampled_from(".....:,"), numbers),
    numbers,
    st.text(max_size=80),
    st.builds(lambda a, b: a + "." + b, numbers, st.text(max_size=8)),
)


def cursor_answer(text: str) -> int:
    """The status the stream owes the cursor ``text`` as the server reads it: 200 for two
    whole numbers the columns hold (ASCII digits, no more of them than the largest value has:
    app.core.ids.parse_number), 400 for anything else, 422 for what the request checks refuse first
    (NUL, over 64 characters). An empty one is no cursor: 200."""
    if "\x00" in text or len(text) > 64:
        return 422
    if not text:
        return 200
    match = re.fullmatch(r"([0-9]+)\.([0-9]+)", text)
    fits = match is not None and all(
        len(digits) <= len(str(limit)) and int(digits) <= limit
        for digits, limit in zip(match.groups(), (MAX_ID, MAX_STEP), strict=True)
    )
    return 200 if fits else 400


@st.composite
def stream_requests(draw: st.DrawFn) -> tuple[str, Headers, dict[str, str]]:
    """(the cursor as the server reads it, headers, query) with the cursor in Last-Event-ID
    (Latin-1 or UTF-8 bytes of the text, or random bytes) or in ?after=."""
    text = draw(cursors)
    how = draw(st.sampled_from(["latin-1", "utf-8", "bytes", "query"]))
    if how == "query":  # sent as UTF-8, read back as the text
        return text, {}, {"after": text}
    raw = draw(st.binary(max_size=70)) if how == "bytes" else text.encode(how, "ignore")
    return raw.decode("latin-1"), {"Last-Event-ID": raw}, {}


def test_last_event_id_fuzz(target: Target) -> None:
    jobs = []
    for _ in range(2):
        created = target.client.post("/v1/jobs", json=tiny_spec(), headers=target.auth)
        assert created.status_code == 201, created.text
        jobs.append(created.json()["id"])
    # One job's stream ends by itself (it is cancelled); the other's runs until the client
    # leaves, which it does once it has the status and headers.
    target.client.post(f"/v1/jobs/{jobs[0]}/cancel", headers=target.auth)
    statuses: list[int] = []

    @given(request=stream_requests(), job_id=st.sampled_from(jobs))
    @settings(FUZZ, max_examples=200)
    def exercise(request: tuple[str, Headers, dict[str, str]], job_id: str) -> None:
        text, headers, params = request
        response = target.request(
            "GET", f"/v1/jobs/{job_id}/stream", headers=target.auth | headers, params=params
        )
        target.check("GET", STREAM, response, request)
        assert response.status_code == cursor_answer(text), (request, response.text[:300])
        if response.status_code == 200:
            assert response.headers["content-type"].startswith("text/event-stream")
        else:
            param = error_of(response)["param"].lower()
            assert param in ("last-event-id", "after"), (request, param)
        statuses.append(response.status_code)

    exercise()
    assert {200, 400, 422} <= set(statuses), statuses


# ---- Idempotency-Key ------------------------------------------------------------------------

CREATES = ("/v1/jobs", "/v1/fine_tuning/jobs")
ODD_KEYS = ("", " ", "\t", "\xa0", "\x85", "\x1f", "a" * 255, "a" * 256, "k\r\nX-Evil: 1", "\x00")
keys = st.one_of(
    st.sampled_from(ODD_KEYS),
    st.text(min_size=1, max_size=300),
    st.text(alphabet="ab \xa0", min_size=1, max_size=3),  # short: keys come back often
)
STRING_CHECK = {
    "type": "string_check",
    "name": "exact",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "operation": "eq",
}


def key_refused(key: str) -> bool:
    """Whether the server must refuse the key, as it reads it: NUL, blank, over 255."""
    return "\x00" in key or not key.strip() or len(key) > 255


def test_idempotency_key_fuzz(target: Target) -> None:
    upload = target.client.post(
        "/v1/files",
        files={"file": ("train.jsonl", b'{"prompt": "2+2?", "answer": "4"}\n' * 4)},
        data={"purpose": "fine-tune"},
        headers=target.auth,
    )
    assert upload.status_code == 201, upload.text
    file_id = upload.json()["id"]

    def body(route: str, variant: int) -> dict[str, Any]:
        if route == "/v1/jobs":
            return tiny_spec(steps=1 + variant)
        return {
            "model": "tiny-random-llama",
            "training_file": file_id,
            "seed": variant,
            "method": {"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}},
            "grpo_service": {"rollout": {"engine": "transformers"}},
        }

    # What the server must have stored: each key, as it reads it, to the request that took it.
    taken: dict[str, tuple[str, int]] = {}
    outcomes: list[str] = []

    @given(
        raw=keys,
        encoding=st.sampled_from(["latin-1", "utf-8"]),
        sends=st.lists(
            st.tuples(st.sampled_from(CREATES), st.integers(0, 1)), min_size=1, max_size=3
        ),
    )
    # No shrinking: `taken` is state across examples, which a shrunk replay would not have.
    @settings(FUZZ, max_examples=100, phases=[Phase.explicit, Phase.generate])
    def exercise(raw: str, encoding: str, sends: list[tuple[str, int]]) -> None:
        header = raw.encode(encoding, "ignore")
        key = header.decode("latin-1")
        for route, variant in sends:
            response = target.request(
                "POST",
                route,
                headers=target.auth
                | {"Content-Type": "application/json", "Idempotency-Key": header},
                content=json.dumps(body(route, variant)).encode(),
            )
            what = (route, variant, key)
            target.check("POST", route, response, what)
            created = 201 if route == "/v1/jobs" else 200
            refused = 422 if route == "/v1/jobs" else 400  # OpenAI's paths answer 400
            if key_refused(key):
                assert response.status_code == refused, (what, response.text[:300])
                assert error_of(response)["param"].lower() == "idempotency-key", what
                outcomes.append("refused")
            elif key not in taken:
                assert response.status_code == created, (what, response.text[:300])
                assert "Idempotent-Replayed" not in response.headers, what
                taken[key] = (route, variant)
                outcomes.append("created")
            elif taken[key] == (route, variant):
                assert response.status_code == created, (what, response.text[:300])
                assert response.headers["Idempotent-Replayed"] == "true", what
                outcomes.append("replayed")
            else:
                assert response.status_code == refused, (what, taken[key], response.text[:300])
                assert error_of(response)["code"] == "idempotency_key_reused", what
                outcomes.append("reused")

    exercise()
    assert {"refused", "created", "replayed", "reused"} <= set(outcomes), outcomes


# ---- the session cookie ---------------------------------------------------------------------


def tampered(token: str) -> st.SearchStrategy[str]:
    """A valid token changed: cut, a character replaced, a part dropped or doubled."""
    parts = token.split(".")
    return st.one_of(
        st.integers(0, len(token) - 1).map(lambda n: token[:n]),
        st.tuples(st.integers(0, len(token) - 1), st.characters(max_codepoint=255)).map(
            lambda t: token[: t[0]] + t[1] + token[t[0] + 1 :]
        ),
        st.integers(0, len(parts) - 1).map(lambda n: ".".join(parts[:n] + parts[n + 1 :])),
        st.just(token + "." + parts[-1]),
        st.just(token * 2),
        st.just(token.upper()),
    )


def forged(sign: Callable[[str], str], key_id: str, made: set[str]) -> st.SearchStrategy[str]:
    """Tokens signed with the server's own secret around hostile claims (numbers that int()
    reads oddly or not at all, other versions, another key), each added to ``made``: the only
    tokens besides the valid one that may sign in."""

    def signed(payload: str) -> str:
        token = f"{payload}.{sign(payload)}"
        made.add(token)
        return token

    field = st.one_of(
        st.sampled_from(["", "-1", "0", "1_000", " 7 ", "\u0663", "9" * 60, "1e9", "x"]),
        st.integers(-(2**70), 2**70).map(str),
    )
    payloads = st.one_of(
        st.builds(lambda i, e: f"v2.{key_id}.{i}.{e}", field, field),
        st.builds(lambda e: f"v1.{key_id}.{e}", field),
        st.builds(lambda k: f"v2.{k}.0.{2**40}", st.text(max_size=40)),
        st.builds(lambda v: f"{v}.{key_id}.0.{2**40}", st.text(max_size=4)),
    )
    return payloads.map(signed)


def cookie_pairs(session_values: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    name = st.one_of(st.just(SESSION_COOKIE), st.text(max_size=12), st.just(SESSION_COOKIE + " "))
    pair = st.one_of(
        st.builds(lambda v: f"{SESSION_COOKIE}={v}", session_values),
        st.builds(lambda v: f'{SESSION_COOKIE}="{v}"', session_values),
        st.builds(lambda n, v: f"{n}={v}", name, st.text(max_size=30)),
        st.text(max_size=30),  # no '=' at all, stray quotes and separators
    )
    return st.lists(pair, max_size=60).flatmap(
        lambda pairs: st.sampled_from(["; ", ";", ", ", " ; "]).map(lambda sep: sep.join(pairs))
    )


@st.composite
def cookie_headers(draw: st.DrawFn, valid: str, session_values: Any) -> bytes:
    kind = draw(st.sampled_from(["pairs", "pairs", "valid", "amid", "huge"]))
    if kind == "valid":
        text = f"{SESSION_COOKIE}={valid}"
    elif kind == "amid":  # among many other cookies
        others = draw(st.lists(st.from_regex(r"[a-z]{1,8}=[^;\x00]{0,20}", fullmatch=True)))
        at = draw(st.integers(0, len(others)))
        text = "; ".join([*others[:at], f"{SESSION_COOKIE}={valid}", *others[at:]])
    elif kind == "huge":
        size = draw(st.sampled_from([300, 8_000, 64_000]))
        text = f"{SESSION_COOKIE}={valid[:5]}{'A' * size}; other={'b' * size}"
    else:
        text = draw(cookie_pairs(session_values))
    return text.encode(draw(st.sampled_from(["utf-8", "latin-1"])), "ignore")


COOKIE_CALLS = (
    ("GET", "/v1/session", "/v1/session"),
    ("GET", "/v1/jobs", "/v1/jobs"),
    ("POST", "/v1/jobs/{job_id}/cancel", "/v1/jobs/{job}/cancel"),
    ("DELETE", "/v1/session", "/v1/session"),
)


def cookie_answers(
    method: str, cookie: str, csrf: str | None, bearer: str | None, valid: str, made: set[str]
) -> set[int]:
    """The statuses a call owes the Cookie header ``cookie`` as the server reads it and its
    other credentials (app.sessions.deps.get_principal, app.sessions.routes)."""
    if "\x00" in cookie:
        return {422}
    seen = cookie_parser(cookie).get(SESSION_COOKIE)  # by Starlette's own parser
    csrf_sent = bool((csrf or "").strip())
    if method == "DELETE":  # signing out needs no credentials, only the header with a cookie
        return {403} if seen is not None and not csrf_sent else {204}
    if bearer is not None or seen is None:
        return {401}  # a Bearer header wins over any cookie
    if method == "POST" and not csrf_sent:
        return {403}
    if seen == valid:
        return {200}
    return {200, 401} if seen in made else {401}  # a forged token may still name the key


def test_cookie_fuzz(target: Target) -> None:
    tokens = target.app.state.grpo.session_tokens
    mine = target.client.get("/v1/session", headers=target.auth).json()["key_id"]
    # A sign-out ends every session of its key: sign-outs get a key of their own, so the
    # other calls' valid token stays valid.
    other_key, _ = new_project_key(target.app.state.grpo.settings)
    other_auth = {"Authorization": f"Bearer {other_key}"}
    other = target.client.get("/v1/session", headers=other_auth).json()["key_id"]
    valid = {key_id: tokens.issue(key_id)[0] for key_id in (mine, other)}
    made: set[str] = set()
    job = target.client.post("/v1/jobs", json=tiny_spec(), headers=target.auth).json()["id"]

    def values(key_id: str) -> st.SearchStrategy[str]:
        token = valid[key_id]
        return st.one_of(
            st.just(token),
            tampered(token),
            forged(tokens._sign, key_id, made),
            st.text(max_size=250),
        )

    @st.composite
    def requests(draw: st.DrawFn) -> tuple[str, str, str, bytes, str | None, str | None]:
        method, template, path = draw(st.sampled_from(COOKIE_CALLS))
        key_id = other if method == "DELETE" else mine
        cookie = draw(cookie_headers(valid[key_id], values(key_id)))
        csrf = draw(st.sampled_from([None, "1", "", " "]))
        bearer = draw(st.sampled_from([None, None, None, "Bearer nope", "Basic x"]))
        return method, template, path.format(job=job), cookie, csrf, bearer

    statuses: list[int] = []

    @given(request=requests())
    @settings(FUZZ, max_examples=200)
    def exercise(request: tuple[str, str, str, bytes, str | None, str | None]) -> None:
        method, template, path, cookie, csrf, bearer = request
        headers: Headers = {"Cookie": cookie}
        if csrf is not None:
            headers[CSRF_HEADER] = csrf
        if bearer is not None:
            headers["Authorization"] = bearer
        response = target.request(method, path, headers=headers)
        what = (method, path, cookie[:200], csrf, bearer)
        target.check(method, template, response, what)
        expected = cookie_answers(method, cookie.decode("latin-1"), csrf, bearer, valid[mine], made)
        assert response.status_code in expected, (what, response.status_code, response.text)
        statuses.append(response.status_code)

    exercise()
    assert {200, 401, 403, 204} <= set(statuses), statuses
