"""Where the gateway's workers come from: static lists, a file rewritten at run time, DNS."""

from __future__ import annotations

import asyncio
import json

from services.gateway.routing.endpoints import EndpointSet, _resolve


def listed(endpoints: EndpointSet) -> set[tuple[str, str]]:
    return {(e.role, e.address) for e in endpoints.endpoints()}


def test_the_workers_file_is_reread_when_it_changes_and_a_bad_one_keeps_the_last_list(tmp_path):
    asyncio.run(_workers_file_is_reread(tmp_path))


async def _workers_file_is_reread(tmp_path):
    path = tmp_path / "workers.json"
    path.write_text(json.dumps({"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]}))
    endpoints = EndpointSet({"both": ["127.0.0.1:3"]}, workers_file=str(path))
    await endpoints.refresh()
    assert listed(endpoints) == {
        ("both", "127.0.0.1:3"),
        ("prefill", "127.0.0.1:1"),
        ("decode", "127.0.0.1:2"),
    }
    assert not endpoints.eligible("prefill")  # nothing answers there: listed, not healthy

    path.write_text(json.dumps({"prefill": ["127.0.0.1:4"], "decode": ["127.0.0.1:2"]}))
    await endpoints.refresh()
    assert listed(endpoints) == {
        ("both", "127.0.0.1:3"),
        ("prefill", "127.0.0.1:4"),
        ("decode", "127.0.0.1:2"),
    }

    path.write_text("{not json")
    await endpoints.refresh()
    assert ("prefill", "127.0.0.1:4") in listed(endpoints)
    await endpoints.close()


def test_dns_entries_expand_to_every_address_the_name_resolves_to():
    assert "127.0.0.1:7000" in asyncio.run(_resolve("dns:localhost:7000"))
    assert asyncio.run(_resolve("dns:no-such-host.invalid:7000")) == []
    assert asyncio.run(_resolve("10.0.0.5:7000")) == ["10.0.0.5:7000"]


def test_the_http_port_answers_without_nagle():
    """The gateway's HTTP connections have TCP_NODELAY: asyncio sets it only where the listening
    socket says TCP. Without it a response written in two parts waited ~40 ms for the client's
    delayed ACK (a request after `GET /metrics` on a kept-alive connection: 46-69 ms, now 3-9)."""
    import asyncio
    import socket

    from services.gateway.__main__ import _listen

    async def accepted_nodelay() -> int:
        sock = _listen("127.0.0.1", 0)
        seen = asyncio.get_running_loop().create_future()

        async def handle(reader, writer):
            conn = writer.get_extra_info("socket")
            seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            nodelay = await asyncio.wait_for(seen, 10)
            writer.close()
        return nodelay

    assert asyncio.run(accepted_nodelay()) == 1
