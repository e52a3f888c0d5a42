"""Read-only HTTP routes under /chorus/api/: bank statistics (with recordings still pending or
failed, and how many wait in the spool), recent entries, and one recording's state.

Banks are named, never given as paths: a name is looked up among the folders registered as
``chorus_banks`` and the named PostgreSQL banks, so a client cannot point the server at an
arbitrary file or database. No answer carries a server path or a bank URL (host, user,
password): stats carry the bank's name, and errors a short text; the whole one goes to the log.

A bank is opened and read on a worker thread, never on ComfyUI's event loop: a PostgreSQL
server that does not answer would otherwise stall the whole UI for the connect timeout.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from .bank_nodes import bank_path, existing_banks

_registered = False
ANSWER_TIMEOUT_S = 3  # the client's wait for a bank; the worker thread ends at the connect timeout


def _open_named(name: str):
    from ..chorus_core.bank import BankError, MaskBank
    from ..chorus_core.bank.bank_url import is_bank_url

    if name not in existing_banks():
        raise web.HTTPNotFound(text=f"no bank named {name!r}; GET /chorus/api/banks lists them")
    location = bank_path(name)
    try:
        return MaskBank.open(location, read_only=True, create=False)
    except BankError as exc:  # a short answer; the whole text (server paths, hosts) goes to the server's log
        logging.warning("Chorus: bank %s cannot be opened: %s", name, exc)
        if is_bank_url(location):
            raise web.HTTPConflict(text=f"the PostgreSQL bank {name!r} cannot be opened (server "
                                        "unreachable, or not a bank); the ComfyUI log says why") from None
        raise web.HTTPConflict(text=f"the bank {name!r} cannot be opened (damaged, not a Chorus bank, or "
                                    "made by a newer Chorus); the ComfyUI log says why") from None


def _public_stats(name: str, bank) -> dict:
    from ..chorus_core.bank import spool

    stats = bank.stats()
    stats["path"] = name  # never the server's folder, nor a PostgreSQL bank's server and user
    stats["spooled"] = spool.spooled_count(bank)
    stats["recordings"] = _recordings(bank)
    return stats


def _recordings(bank) -> list[dict]:
    """This server's recordings still on their way into ``bank``, and those that failed."""
    from ..chorus_core.reuse.bank_writer import recordings

    return [_public_recording(item) for item in recordings(bank.label)]


def _public_recording(item: dict) -> dict:
    """A recording's state with the error's kind and short reason only (the whole text may name
    server paths; the ComfyUI log has it)."""
    kind = (item.get("error") or "").split(":", 1)[0]
    return {**item, "error": f"{kind} (the ComfyUI log says why)" if kind else None}


async def recording_state(request: web.Request) -> web.Response:
    """Where one recording of this server is: queued, retrying, recorded, failed (with a short reason)
    or unknown (never queued here, or forgotten since). Polled by the web view while a recording is
    queued: answered from the writer's memory, no bank is opened."""
    from ..chorus_core.bank.validation import is_entry_id
    from ..chorus_core.reuse.bank_writer import recording_state as state_of

    entry_id = request.match_info["entry_id"]
    if not is_entry_id(entry_id):
        raise web.HTTPBadRequest(text="an entry id is 32 lowercase hex digits")
    return web.json_response(_public_recording(state_of(entry_id)))


async def list_banks(request: web.Request) -> web.Response:
    return web.json_response({"banks": existing_banks()})


async def bank_stats(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    return web.json_response(await _read_off_loop(name, lambda bank: _public_stats(name, bank)))


async def recent_entries(request: web.Request) -> web.Response:
    try:
        limit = min(max(int(request.query.get("limit", "20")), 1), 200)
    except ValueError:
        raise web.HTTPBadRequest(text="limit must be an integer between 1 and 200") from None
    entries = await _read_off_loop(request.match_info["name"], lambda bank: bank.recent(limit))
    return web.json_response({"entries": entries}, dumps=_dumps)


async def _read_off_loop(name: str, read):
    """``read(bank)`` of the named bank on a worker thread, answered within ANSWER_TIMEOUT_S."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(_read_named, name, read), ANSWER_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise web.HTTPGatewayTimeout(text=f"the bank {name!r} did not answer within {ANSWER_TIMEOUT_S} s (a "
                                          "PostgreSQL server that does not respond?); the ComfyUI log says why "
                                          "once its connect timeout ends") from None


def _read_named(name: str, read):
    bank = _open_named(name)  # on this thread: SQLite connections stay on the thread that made them
    try:
        return read(bank)
    finally:
        bank.close()


def _dumps(value) -> str:
    import json

    return json.dumps(value, default=str)


def register() -> None:
    """Add the routes once to ComfyUI's server (absent in in-process use)."""
    global _registered
    try:
        from server import PromptServer
    except ImportError:
        return
    if _registered or getattr(PromptServer, "instance", None) is None:
        return
    routes = PromptServer.instance.routes
    routes.get("/chorus/api/banks")(list_banks)
    routes.get("/chorus/api/banks/{name}/stats")(bank_stats)
    routes.get("/chorus/api/banks/{name}/recent")(recent_entries)
    routes.get("/chorus/api/recordings/{entry_id}")(recording_state)
    _registered = True
    logging.debug("Chorus: routes registered under /chorus/api/")
