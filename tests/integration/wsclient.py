"""A WebSocket client for the port tests, wsproto over a plain socket: it shows what a proxy must pass on
(the subprotocol chosen, every message, the close code) and what it refuses with (the handshake's
status), which higher-level clients hide."""

from __future__ import annotations

import socket
from typing import Any

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    RejectConnection,
    Request,
    TextMessage,
)


def ws_talk(
    url: str,
    messages: list[str | bytes],
    subprotocols: list[str],
    *,
    host: str | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> tuple[str | None, list[object], int]:
    """Open a WebSocket at ``url`` (``http://HOST:PORT/path``), send ``messages``, read as many answers,
    close with 4001; the subprotocol chosen, the answers and the close code that came back, or (None,
    [status], -1) when the handshake is refused. ``host``: the Host header, if not the URL's."""
    rest = url.removeprefix("http://")
    hostport, _, path = rest.partition("/")
    addr, _, port = hostport.partition(":")
    ws = WSConnection(ConnectionType.CLIENT)
    with socket.create_connection((addr, int(port)), timeout=30) as sock:
        opening = Request(
            host=host or hostport, target="/" + path, subprotocols=subprotocols, extra_headers=headers or []
        )
        sock.sendall(ws.send(opening))
        answers: list[object] = []
        parts: list[Any] = []
        chosen: str | None = None
        close_code = -1
        sent = False
        while close_code == -1:
            data = sock.recv(65536)
            ws.receive_data(data or None)
            for event in ws.events():
                if isinstance(event, AcceptConnection):
                    chosen = event.subprotocol
                elif isinstance(event, RejectConnection):
                    return None, [event.status_code], -1
                elif isinstance(event, TextMessage | BytesMessage):
                    parts.append(event.data)
                    if event.message_finished:  # a big message arrives in pieces
                        answers.append("".join(parts) if isinstance(event, TextMessage) else b"".join(parts))
                        parts = []
                elif isinstance(event, CloseConnection):
                    close_code = event.code
            if chosen is not None and not sent:
                for m in messages:
                    sock.sendall(ws.send(TextMessage(data=m) if isinstance(m, str) else BytesMessage(data=m)))
                sent = True
            if sent and len(answers) == len(messages) and ws.state.name == "OPEN":
                sock.sendall(ws.send(CloseConnection(code=4001)))
            if not data:
                break
        return chosen, answers, close_code
