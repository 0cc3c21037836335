"""A WebSocket echo server in the standard library alone, run inside sandboxes by test_ports.py (the
images have python3 but no WebSocket package): it answers a text message with the request's path and the
text, a binary one with the bytes, and closes with the client's code."""

import base64
import hashlib
import socket
import struct
import sys
import threading

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def frame(op: int, payload: bytes) -> bytes:
    n = len(payload)
    size = bytes([n]) if n < 126 else b"\x7e" + struct.pack(">H", n) if n < 65536 else b"\x7f" + struct.pack(">Q", n)
    return bytes([0x80 | op]) + size + payload


def serve(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(4096)
    lines = data.split(b"\r\n\r\n")[0].decode().split("\r\n")
    path = lines[0].split()[1]
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    accept = base64.b64encode(hashlib.sha1((headers["sec-websocket-key"] + GUID).encode()).digest()).decode()
    reply = "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    reply += f"Sec-WebSocket-Accept: {accept}\r\n"
    protocol = headers.get("sec-websocket-protocol", "").split(",")[0].strip()
    if protocol:
        reply += f"Sec-WebSocket-Protocol: {protocol}\r\n"
    conn.sendall((reply + "\r\n").encode())
    f = conn.makefile("rb")
    while True:
        b1, b2 = f.read(2)
        op, n = b1 & 0x0F, b2 & 0x7F
        if n == 126:
            n = struct.unpack(">H", f.read(2))[0]
        elif n == 127:
            n = struct.unpack(">Q", f.read(8))[0]
        mask = f.read(4)
        payload = bytes(c ^ mask[i % 4] for i, c in enumerate(f.read(n)))
        if op == 8:
            conn.sendall(frame(8, payload[:2]))
            return
        conn.sendall(frame(op, (path + " " + payload.decode()).encode() if op == 1 else payload))


listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen()
while True:
    c, _ = listener.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
