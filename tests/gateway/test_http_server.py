"""The gateway's HTTP server (splitserve/gateway/openai_api/server.py) below the application."""
import asyncio
import http.client
import socket

from splitserve.gateway.openai_api.server import HttpServer, bind


async def _hello(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
    await send({"type": "http.response.body", "body": b"hello"})  # a second write, after the headers


def test_connections_send_at_once_without_nagles_delay():
    # asyncio leaves TCP_NODELAY off on connections accepted from a socket.create_server socket
    # (bind), and then an answer's body, written after its headers, waited for the client's
    # delayed ACK: 44 ms a request on loopback. Every accepted connection must have it on.
    async def main():
        server = await HttpServer(_hello, bind("127.0.0.1", 0)).start()
        try:
            def client():
                conn = http.client.HTTPConnection("127.0.0.1", server.port)
                answers = []
                for _ in range(3):  # kept alive: the case Nagle's algorithm delayed
                    conn.request("GET", "/")
                    answers.append(conn.getresponse().read())
                return conn, answers
            conn, answers = await asyncio.to_thread(client)
            assert answers == [b"hello"] * 3
            [connection] = server._server.server_state.connections
            sock = connection.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            conn.close()
        finally:
            await server.stop()
    asyncio.run(main())

