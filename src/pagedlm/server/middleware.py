"""ASGI middleware that runs before any parsing: Host header, API key, JSON Content-Type from browsers, body size."""
from __future__ import annotations

import hmac
import ipaddress
from typing import Any

from pagedlm.server.limits import KeyLeases
from pagedlm.server.protocol import APIError
from pagedlm.server.wire import error_response

PUBLIC_PATHS = frozenset({"/", "/health", "/metrics", "/version", "/api/version", "/ui"})
PUBLIC_PREFIXES = ("/ui/",)  # the web view's page and assets hold no data (server/ui.py)
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


class Guard:
    """ASGI middleware, before any parsing: Host header (400, DNS rebinding), API key (401: a bearer token, or
    Anthropic's `x-api-key` header), JSON Content-Type from browsers (415: no "simple" cross-site form posts,
    `from_browser`) and request-body size (413); errors in the shape of the API the path belongs to (api_errors.py).
    A request with a key gets a `key_lease` in its state (see limits.KeyLeases), and every request a list `holds`
    (its shares of server-wide budgets: limits.LogprobHold), all given back when the app has answered (or the
    client went away)."""

    def __init__(self, app: Any, api_keys: list[str], max_body_bytes: int,
                 allowed_hosts: frozenset[str] | None = None, leases: KeyLeases | None = None) -> None:
        self.app, self.api_keys, self.max_body_bytes = app, api_keys, max_body_bytes
        self.allowed_hosts, self.leases = allowed_hosts, leases

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]

        def error(e: APIError) -> Any:
            return error_response(e, path)(scope, receive, send)

        if self.allowed_hosts is not None and not host_allowed(headers.get("host", ""), self.allowed_hosts):
            return await error(APIError(400, "Invalid Host header (see --allowed-hosts).", code="invalid_host"))
        lease, holds = None, []
        scope.setdefault("state", {})["holds"] = holds
        if self.api_keys and path not in PUBLIC_PATHS and not path.startswith(PUBLIC_PREFIXES):
            key = self._key(headers.get("authorization", ""), headers.get("x-api-key"))
            if key is None:
                return await error(APIError(401, "Invalid or missing API key (send `Authorization: Bearer <key>` "
                                                 "or `x-api-key: <key>`).", code="invalid_api_key",
                                            headers={"WWW-Authenticate": "Bearer"}))
            scope.setdefault("state", {})["api_key"] = key
            if self.leases is not None:
                scope["state"]["key_lease"] = lease = self.leases.lease(key)
        if scope["method"] == "POST" and from_browser(headers):
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return await error(APIError(415, "The request body must be JSON (Content-Type: application/json).",
                                            code="unsupported_media_type"))
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await error(APIError(400, "Invalid Content-Length."))
            if int(length) > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
        seen, rejected = 0, False

        async def limited_receive() -> dict:
            nonlocal seen, rejected
            msg = await receive()
            if msg["type"] == "http.request" and not rejected:
                seen += len(msg.get("body", b""))
                if seen > self.max_body_bytes:
                    rejected = True
                    await self._too_large(scope, receive, send)
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg: dict) -> None:
            if not rejected:
                await send(msg)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not rejected:
                raise
        finally:
            if lease is not None:
                lease.release()
            for hold in holds:
                hold.release()

    def _key(self, authorization: str, x_api_key: str | None = None) -> str | None:
        """The configured key the request carries, else None: `Authorization` (scheme `Bearer`, any case), or
        without that header `x-api-key` (Anthropic's clients)."""
        scheme, _, token = authorization.strip().partition(" ")
        if not authorization.strip() and x_api_key is not None:
            scheme, token = "bearer", x_api_key
        token = token.strip().encode()
        found = None
        for key in self.api_keys:  # compare with every key: the time taken does not tell which matched
            if hmac.compare_digest(token, key.encode()):
                found = key
        return found if scheme.lower() == "bearer" else None

    async def _too_large(self, scope: dict, receive: Any, send: Any) -> None:
        await error_response(APIError(413, f"The request body exceeds {self.max_body_bytes} bytes.",
                                       code="request_too_large"), scope["path"])(scope, receive, send)


def from_browser(headers: dict[str, str]) -> bool:
    """Whether a request may come from a web page: browsers send `Origin` with every POST, and `Sec-Fetch-Site` with
    every request (Chrome since 2019, Firefox since 2021, Safari since 2023). curl, the SDKs and Ollama's documented
    `curl -d '{...}'` send neither, so their bodies are read as JSON whatever their Content-Type says."""
    return "origin" in headers or "sec-fetch-site" in headers


def host_allowed(host: str, allowed: frozenset[str]) -> bool:
    """`host` (a Host header: name, IPv4 or [IPv6], with an optional port) is in `allowed` or is a loopback
    address; "*" in `allowed` admits any."""
    if "*" in allowed:
        return True
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    if not host:
        return False
    if host in allowed:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback  # 127.0.0.0/8, ::1: loopback names are always allowed
    except ValueError:
        return False
