"""The incident pages the worker serves (loopback by default, settings.page_port): `/` lists
the newest incidents, `/incidents/<incident_id>` is one incident's page (diagnosis/page/). The
database is the worker's own; pages are built in a thread off the event loop. Only GET, only
these two paths; an unknown incident is a 404 that says so."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from aiohttp import web

from diagnosis.page import data as page_data
from diagnosis.page.render import incident_page, index_page
from streams.db import ClickHouseError

log = logging.getLogger("rankwatch.pages")
MAX_ID = 1000


def db_query(db: Any) -> page_data.Query:
    def query(sql: str) -> list[dict[str, Any]]:
        raw: bytes = db.query(sql, fmt="JSONEachRow")
        return [orjson.loads(line) for line in raw.splitlines() if line.strip()]

    return query


def unavailable(e: ClickHouseError) -> web.HTTPServiceUnavailable:
    log.warning("incident page: %s", e)
    return web.HTTPServiceUnavailable(text=f"the database could not answer: {e}")


def app(query: page_data.Query) -> web.Application:
    async def index(_req: web.Request) -> web.Response:
        try:
            rows = await asyncio.to_thread(page_data.incidents, query)
        except ClickHouseError as e:
            raise unavailable(e) from None
        return web.Response(text=index_page(rows), content_type="text/html")

    async def incident(req: web.Request) -> web.Response:
        iid = req.match_info["incident_id"]
        if len(iid) > MAX_ID:
            raise web.HTTPBadRequest(text="incident id too long")
        try:
            d = await asyncio.to_thread(page_data.load, query, iid)
        except ClickHouseError as e:
            raise unavailable(e) from None
        if d is None:
            raise web.HTTPNotFound(text=f"no incident {iid!r} is stored (see / for the list)")
        return web.Response(text=incident_page(d), content_type="text/html")

    a = web.Application()
    a.router.add_get("/", index)
    a.router.add_get("/incidents/{incident_id}", incident)
    return a


async def start(query: page_data.Query, host: str, port: int) -> web.AppRunner | None:
    """Serve the pages; None (logged) when the port cannot be bound — pages never stop the
    worker."""
    runner = web.AppRunner(app(query), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        log.warning("incident pages: cannot listen on %s:%d (%s)", host, port, e.strerror)
        await runner.cleanup()
        return None
    log.info("incident pages on http://%s:%d/", host, port)
    return runner
