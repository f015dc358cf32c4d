"""The memory views' server side: `GET /debug/state` (JSON; the API key is required as on every API route) and `/ui`
(the web view's static files, shipped in the package under static/ui; public, as they hold no data: the page asks
for the key and sends it with its own requests).

/debug/state gathers, per served model (and per replica with data parallelism), the engine's `EngineSnapshot`
(engine/snapshot.py), its recent latencies, and the router's last decisions. Watchers share snapshots: each engine
builds at most one every `MIN_INTERVAL` seconds, whoever asks, and none while nobody asks.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response

from pagedlm import __version__
from pagedlm.engine.client import EngineClient
from pagedlm.server.dispatch import LoadTracker
from pagedlm.server.protocol import APIError

if TYPE_CHECKING:
    from pagedlm.router import Router

STATIC = Path(__file__).resolve().parent / "static" / "ui"
ASSETS = {"app.js": "text/javascript", "panels.js": "text/javascript", "style.css": "text/css"}
MIN_INTERVAL = 0.2  # seconds between two snapshots of one engine
SNAPSHOT_TIMEOUT = 10.0  # seconds to wait for an engine between steps (a long prefill step)
LATENCY_WINDOW = 10.0  # seconds of TTFT / inter-token samples averaged
HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY",
           "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                      "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"}


def latency_state(latency: LoadTracker) -> dict[str, float | None]:
    """The engine's mean TTFT and inter-token latency of the last LATENCY_WINDOW seconds, in milliseconds."""
    ttft, tpot = latency.recent_means()
    return {"ttft_ms": None if ttft is None else 1000 * ttft, "tpot_ms": None if tpot is None else 1000 * tpot}


class SnapshotCache:
    """One engine's latest snapshot as JSON data, rebuilt at most every MIN_INTERVAL seconds; concurrent watchers
    await the same build."""

    def __init__(self, engine: EngineClient, show_text: bool) -> None:
        self.engine, self.show_text = engine, show_text
        self._last: tuple[float, dict] | None = None
        self._building: asyncio.Future | None = None

    async def get(self) -> dict:
        if self._last is not None and time.monotonic() - self._last[0] < MIN_INTERVAL:
            return self._last[1]
        if self._building is None or self._building.done():
            self._building = asyncio.ensure_future(self._build())
        return await asyncio.shield(self._building)

    async def _build(self) -> dict:
        try:
            snap = await asyncio.wait_for(self.engine.snapshot(self.show_text), SNAPSHOT_TIMEOUT)
            data = await asyncio.to_thread(snap.to_dict)
        except NotImplementedError:
            data = {"error": "this engine does not show its memory"}
        except asyncio.TimeoutError:
            data = {"error": f"the engine did not pause between steps within {SNAPSHOT_TIMEOUT:g} s"}
        except Exception as e:  # noqa: BLE001 - a dead engine is shown as such
            data = {"error": f"{type(e).__name__}: {e}"}
        self._last = (time.monotonic(), data)
        return data


class MemoryState:
    """What /debug/state answers, for the served engines and the router."""

    def __init__(self, engines: Mapping[str, EngineClient], router: Router | None = None,
                 show_text: bool = False) -> None:
        self.router, self.show_text = router, show_text
        self.models = {}
        for name, engine in engines.items():
            parts = dict(engine.replicas) or {"0": engine}
            self.models[name] = (LoadTracker(engine, LATENCY_WINDOW),
                                 {r: SnapshotCache(e, show_text) for r, e in parts.items()})

    async def state(self) -> dict:
        models = {}
        for name, (latency, caches) in self.models.items():
            replicas = dict(zip(caches, await asyncio.gather(*(c.get() for c in caches.values()))))
            models[name] = {"latency": latency_state(latency), "replicas": replicas}
        return {"version": __version__, "time": time.time(), "show_text": self.show_text, "models": models,
                "router": router_state(self.router) if self.router is not None else None}


def router_state(router: Router) -> dict:
    """The router's last served decisions, realised vs target strong share, and spend vs budget."""
    share = router.served.stats()
    cal = router.calibrator
    budget = router.budget.state() if router.budget is not None else None
    decisions = [{"time": t, "model": d.model, "replica": d.replica, "category": d.category, "reason": d.reason,
                  "score": d.score, "threshold": thr, "tier": d.tier, "policy_strong": d.policy_strong}
                 for t, d, thr in list(router.recent)]
    return {
        "policy": type(router.policy).__name__, "threshold": getattr(router.policy, "threshold", None),
        "models": [{"name": m.name, "strong": m.strong, "tier": m.rank} for m in router.models.values()],
        "share": {"requests": share.requests, "realised_strong": share.realised, "policy_strong": share.policy,
                  "target_strong": cal.target if cal is not None else None},
        "budget": None if budget is None else {"cap_per_hour": budget.cap_per_hour, "spent": budget.spent,
                                               "held": budget.held, "total_spent": budget.total_spent},
        "decisions": decisions[::-1],  # newest first
    }


def add_ui_routes(app: FastAPI, state: MemoryState) -> None:
    """GET /debug/state and the web view at /ui (its page, scripts and style sheet)."""

    @app.get("/debug/state")
    async def debug_state() -> Response:
        return JSONResponse(await state.state(), headers={"Cache-Control": "no-store"})

    @app.get("/ui")
    async def ui_page() -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=HEADERS)

    @app.get("/ui/{name}")
    async def ui_asset(name: str) -> Response:
        if name not in ASSETS:
            raise APIError(404, f"No such file: /ui/{name}", type="not_found_error", code="not_found")
        return FileResponse(STATIC / name, media_type=ASSETS[name], headers=HEADERS)
