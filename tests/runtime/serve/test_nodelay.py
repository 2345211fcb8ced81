"""Every listening socket the project hands to uvicorn makes asyncio set ``TCP_NODELAY`` on the
connections it accepts (uvicorn issue #3149: a listener with ``proto`` 0 leaves Nagle on, and a
keep-alive client's streamed chunks then wait on its delayed ACK, about 40 ms)."""

from __future__ import annotations

import asyncio
import socket

from agentcache.proxy.cli import _listen
from runtime.serve.cli import bind_socket
from runtime.serve.server_thread import ServerThread


def accepted_nodelay(listener: socket.socket) -> int:
    """``TCP_NODELAY`` of a connection accepted through asyncio on ``listener`` (as uvicorn
    serves it: ``loop.create_server(sock=...)``)."""

    async def main() -> int:
        loop = asyncio.get_running_loop()
        seen: asyncio.Future[int] = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await loop.create_server(Probe, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        server.close()
        await server.wait_closed()
        return value

    return asyncio.run(main())


def test_serve_listener_gets_nodelay_connections() -> None:
    assert accepted_nodelay(bind_socket("127.0.0.1", 0)) == 1


def test_proxy_listener_gets_nodelay_connections() -> None:
    assert accepted_nodelay(_listen("127.0.0.1", 0)) == 1


def test_in_process_server_listener_gets_nodelay_connections() -> None:
    thread = ServerThread(app=None)  # NOTE: its listener only; the thread is never started
    listener = thread._sock
    listener.listen(16)
    assert accepted_nodelay(listener) == 1
