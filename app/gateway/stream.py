"""The response of POST /v1/chat/completions and /v1/completions: an ASGI response that does the
slow part after the route has returned, so the request's unit of work (its database session
and request slot) is committed and released before any engine is waited on.

When the response runs, it:
1. takes one of the project's in-flight slots (GRPO_INFERENCE_MAX_CONCURRENT_PER_PROJECT) and
   the request's work from the project's budget (GRPO_INFERENCE_MAX_TOKENS_IN_FLIGHT_PER_PROJECT:
   choices x max_tokens plus the prompt), in Redis when configured (429 beyond), renewed while
   it runs and released however it ends;
2. has an inference process make the weights ready (app.gateway.routing.ensure_ready; 503
   with Retry-After while an engine starts, 429 with Retry-After while the project's requests
   use its whole share of the engine's adapter slots); a `response_format` request for a model
   that cannot write JSON is a 400 (app.gateway.capabilities); the ensure's hold on LoRA
   adapters is released when the request ends, however it ends (routing.release);
3. forwards the request (app.gateway.proxy: a chat written as the model was trained) and
   answers:
   - not streamed: the engine's bytes, `model` rewritten in place and nothing else parsed, up
     to GRPO_INFERENCE_MAX_RESPONSE_BYTES (app.gateway.answer; 400 beyond); a chat with tools
     the model may call is parsed (in a thread) and its tool calls given in OpenAI's shape
     (app.gateway.chat_as_trained; streaming one is refused before it starts). A client that
     leaves does not stop it: the engine finishes, and the request is charged what it did and
     holds its slot and work until then (aborting it freed both at once and charged nothing,
     so leaving was a way past every budget);
   - streamed: SSE passed through event by event as it arrives, nothing buffered beyond one
     event; a client that leaves cancels the relay, which closes the upstream stream (vLLM
     aborts the generation). An upstream failure after the first byte ends the stream with an
     `error` event (the openai SDK raises it);
4. records the tokens used (app.gateway.quota.record), in a thread, whatever happened: the
   engine's usage (for a stream left early, the engine's running count at its last chunk);
5. an engine that fails to answer while it is down (its /health not 200: it died and the
   inference process restarts it at the next ensure) is a 503 with Retry-After, which the SDK
   waits out, rather than a 502.

Errors before the first byte are ApiErrors, rendered by the app's handlers in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from app.core.clock import utcnow
from app.core.db import session_scope
from app.core.errors import ApiError, InferenceUnavailable, UpstreamFailed, UpstreamTimeout
from app.core.leases import STREAM_RENEW_S, Lease
from app.core.state import AppState
from app.gateway import answer, capabilities, proxy, quota, routing
from app.gateway.protocol import EnsureResponse
from app.gateway.request_schemas import ChatCompletionRequest, InferenceRequest

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ENGINE_HEALTH_S = 2.0  # how long a failed request's engine has to say it is healthy


class UpstreamClients:
    """One pooled httpx client per event loop (a test client runs its own loop); the pool is
    unbounded here because the in-flight slots bound it."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None

    def get(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._loop = loop
            self._client = httpx.AsyncClient(
                trust_env=False,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            )
        return self._client


UPSTREAM = UpstreamClients()


async def _until_disconnect(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _race(work: Callable[[], Awaitable[None]], receive: Receive) -> bool:
    """Run `work` until it ends or the client disconnects (which cancels it); True when the
    client left first."""
    left = False
    async with anyio.create_task_group() as group:

        async def run_work() -> None:
            await work()
            group.cancel_scope.cancel()

        async def watch() -> None:
            nonlocal left
            await _until_disconnect(receive)
            left = True
            group.cancel_scope.cancel()

        group.start_soon(run_work)
        group.start_soon(watch)
    return left


class GatewayResponse(Response):
    """See the module docstring. `plan` was made in the route's unit of work."""

    def __init__(
        self, *, plan: routing.Plan, body: InferenceRequest, project_id: str, state: AppState
    ) -> None:
        super().__init__()
        self.plan, self.request, self.project_id, self.state = plan, body, project_id, state
        self.settings = state.settings
        self._recorded = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limits = self.state.limits
        work = self.request.work(self.settings.inference_max_tokens)
        with anyio.CancelScope(shield=True):  # what is taken is always given back below
            slot = await anyio.to_thread.run_sync(limits.inference_slots.acquire, self.project_id)
            try:
                lease = await anyio.to_thread.run_sync(
                    limits.inference_work.acquire, self.project_id, work
                )
            except BaseException:
                await anyio.to_thread.run_sync(limits.inference_slots.release, slot)
                raise
        error: ApiError | None = None
        try:
            async with anyio.create_task_group() as renewing:
                renewing.start_soon(self._keep_leases, slot, lease)
                try:
                    await self._serve(scope, receive, send)
                except ApiError as exc:  # raised below the group, for the app's handlers
                    error = exc
                finally:
                    renewing.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(limits.inference_work.release, lease)
                await anyio.to_thread.run_sync(limits.inference_slots.release, slot)
        if error is not None:
            raise error

    async def _keep_leases(self, slot: Lease, lease: Lease) -> None:
        limits = self.state.limits
        while True:
            await anyio.sleep(STREAM_RENEW_S)
            await anyio.to_thread.run_sync(limits.inference_slots.renew, slot)
            await anyio.to_thread.run_sync(limits.inference_work.renew, lease)

    def _auth(self) -> dict[str, str]:
        return routing.auth_headers(self.settings.inference_token)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = UPSTREAM.get()
        ready = await routing.ensure_ready(
            client,
            self.plan,
            token=self.settings.inference_token,
            timeout_s=self.settings.inference_ensure_timeout_s,
            retry_after=self.settings.inference_no_server_retry_after_s,
        )
        try:
            await self._answer(client, ready.target, scope, receive, send)
        finally:  # however it ended (an error, the client gone, a cancel): the hold goes back
            with anyio.CancelScope(shield=True):
                await routing.release(client, ready, token=self.settings.inference_token)

    async def _answer(
        self,
        client: httpx.AsyncClient,
        target: EnsureResponse,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        if self.request.wants_json:
            await capabilities.require_json(
                client, target.base_url, target.served_model, self._auth()
            )
        upstream = await self._send(client, target)
        try:
            if upstream.status_code != 200:
                content = await upstream.aread()
                raise await self._failure(
                    client,
                    target,
                    proxy.upstream_error(
                        upstream.status_code,
                        content,
                        body=self.request,
                        served_model=target.served_model,
                    ),
                )
            if self.request.stream:
                await self._stream(upstream, receive, send)
            else:
                await self._once(upstream, target, scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()  # unread: the connection closes, vLLM aborts

    async def _send(self, client: httpx.AsyncClient, target: EnsureResponse) -> httpx.Response:
        request = client.build_request(
            "POST",
            proxy.completion_url(target.base_url, proxy.endpoint_of(self.request)),
            json=proxy.upstream_body(
                self.request,
                target,
                prompt=self.plan.prompt,
                max_tokens=self.settings.inference_max_tokens,
            ),
            headers=self._auth(),
            timeout=proxy.timeouts(self.settings.inference_read_timeout_s),
        )
        try:
            return await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise await self._failure(client, target, _transport_error(exc)) from exc

    async def _failure(
        self, client: httpx.AsyncClient, target: EnsureResponse, error: ApiError
    ) -> ApiError:
        """`error`, or a 503 with Retry-After when the engine failed because it is down."""
        if error.status_code < 500 or await _engine_up(client, target.base_url):
            return error
        return InferenceUnavailable(
            "the inference engine of this model is down (it stopped answering and is started "
            "again at the next request); retry after the wait",
            retry_after=self.settings.inference_no_server_retry_after_s,
            code="engine_unavailable",
        )

    async def _once(
        self,
        upstream: httpx.Response,
        target: EnsureResponse,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        """The engine's answer, to its end even when the client has left (see the module
        doc), charged before it is sent."""
        limit = self.settings.inference_max_response_bytes
        try:
            body = await answer.read_bounded(upstream, limit)
        except httpx.HTTPError as exc:
            raise _transport_error(exc) from exc
        await self._record(proxy.Usage.of(answer.usage_in(body.tail)) or proxy.Usage(0, 0))
        if body.content is None:
            raise answer.too_large(self.request, body.size, limit)
        traits = target.chat_traits  # known: a chat with tools is refused without (proxy)
        if isinstance(self.request, ChatCompletionRequest) and self.request.reads_tool_calls:
            assert traits is not None
            content = await answer.with_tool_calls(body.content, self.plan.model, traits)
        else:
            content = await answer.with_client_model(body.content, self.plan.model)
        await Response(content, media_type="application/json")(scope, receive, send)

    async def _stream(self, upstream: httpx.Response, receive: Receive, send: Send) -> None:
        relay = proxy.SseRelay(
            self.plan.model,
            include_usage=self.request.wants_usage_chunk,
            choices_per_prompt=self.request.n or 1,
        )
        try:
            await send(_start(200, "text/event-stream", SSE_HEADERS))
            await _race(lambda: self._relay(upstream, relay, send), receive)
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()  # unread: the connection closes, vLLM aborts
                if not self._recorded:
                    await self._record(relay.estimated_usage())
        # A client that left gets nothing more; the body is ended for a client still there.
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _relay(self, upstream: httpx.Response, relay: proxy.SseRelay, send: Send) -> None:
        try:
            async for data in upstream.aiter_raw():
                for event in relay.feed(data):
                    if relay.done and not self._recorded:  # before [DONE], as for _once
                        await self._record(relay.estimated_usage())
                    await send({"type": "http.response.body", "body": event, "more_body": True})
        except httpx.HTTPError as exc:
            log.warning("inference stream broke: %r", exc)
        if not relay.done:
            error = _transport_error(None)
            payload = {"error": {"type": "server_error", "code": error.code or error.error_type}}
            payload["error"]["message"] = "the inference engine's stream ended early; retry"
            await send({"type": "http.response.body", "body": _sse(payload), "more_body": True})

    async def _record(self, usage: proxy.Usage) -> None:
        self._recorded = True
        try:
            await anyio.to_thread.run_sync(self._record_now, usage)
        except Exception:  # the answer is given; a lost count must not turn it into an error
            log.exception("inference usage not recorded for project %s", self.project_id)

    def _record_now(self, usage: proxy.Usage) -> None:
        with session_scope(self.state.sessions) as session:
            quota.record(
                session,
                project_id=self.project_id,
                model=self.plan.model,
                now=utcnow(),
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
            )


async def _engine_up(client: httpx.AsyncClient, base_url: str) -> bool:
    """Whether the engine's server says it is healthy (vLLM's /health: 503 once its engine
    core died, nothing once the server exited)."""
    try:
        health = await client.get(f"{base_url.rstrip('/')}/health", timeout=ENGINE_HEALTH_S)
    except httpx.HTTPError:
        return False
    return health.status_code == 200


def _transport_error(exc: Exception | None) -> ApiError:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(
            "the inference engine did not answer in time (GRPO_INFERENCE_READ_TIMEOUT_S)"
        )
    return UpstreamFailed("the connection to the inference engine failed; retry later")


def _start(status: int, media_type: str, headers: dict[str, str]) -> Message:
    raw = [(b"content-type", media_type.encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return {"type": "http.response.start", "status": status, "headers": raw}


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
