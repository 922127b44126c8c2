"""facegate handler `hostile`, in Python: a deliberately misbehaving handler.

**A test program, never seeded nor deployed for users.** The gateway's
tests install it to prove that the sandbox holds a Python handler too.

Any method; the query parameter `attack` picks the misbehaviour:

| `attack` | what the handler does                                | expected host outcome      |
|----------|------------------------------------------------------|----------------------------|
| `loop`   | spins forever in pure computation                    | request deadline (timeout) |
| `memory` | allocates and fills 1 MiB chunks forever, keeps them | memory-limit trap          |
| `network`| a TCP connection to 127.0.0.1:`port`, a name lookup  | 200, JSON of each outcome  |
| other    | nothing: answers 200 with a small JSON               | 200                        |
"""

import json
from urllib.parse import parse_qs

import facegate
from wit_world import exports

MIB = 1 << 20


def spin():
    """Counts forever."""
    counter = 0
    while True:
        counter = (counter + 1) & 0xFFFFFFFF


def hoard():
    """Keeps 1 MiB chunks, every byte written, until the host stops it."""
    chunks = []
    while True:
        chunks.append(b"\xa5" * MIB)


def network(port):
    """Tries a TCP connection to ``port`` on the loopback and a name lookup
    through Python's own ``socket`` module; reports what each came to
    (componentize-py's Python has no ``socket`` module at all today; were
    one added, the host's sockets policy would refuse it)."""
    try:
        import socket
    except ImportError as e:
        return {"tcp": f"unavailable: {e}", "dns": f"unavailable: {e}"}
    outcomes = {}
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            outcomes["tcp"] = "connected"
    except OSError as e:
        outcomes["tcp"] = f"refused: {type(e).__name__}: {e}"
    try:
        socket.getaddrinfo("localhost", port)
        outcomes["dns"] = "resolved"
    except OSError as e:
        outcomes["dns"] = f"refused: {type(e).__name__}: {e}"
    return outcomes


def answer(request):
    query = parse_qs(facegate.query_of(request))
    attack = query.get("attack", [""])[0]
    if attack == "loop":
        spin()
    if attack == "memory":
        hoard()
    outcomes = network(int(query.get("port", ["80"])[0])) if attack == "network" else {}
    body = json.dumps({"handler": "hostile", "language": "python", "attack": attack, "outcomes": outcomes})
    return facegate.pipeline.Reply(status=200, headers=[("content-type", "application/json")], body=body.encode())


class IncomingHandler(exports.IncomingHandler):
    def handle(self, request, response_out):
        facegate.serve(request, response_out, answer)
