"""facegate handler `hostile`, in Python: a deliberately misbehaving handler.

**A test program, never seeded nor deployed for users.** The gateway's
tests install it to prove that the sandbox holds a Python handler too.

Any method; the query parameter `attack` picks the misbehaviour:

| `attack` | what the handler does                                | expected host outcome      |
|----------|------------------------------------------------------|----------------------------|
| `loop`   | spins forever in pure computation                    | request deadline (timeout) |
| `memory` | allocates and fills 1 MiB chunks forever, keeps them | memory-limit trap          |
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


def answer(request):
    attack = parse_qs(facegate.query_of(request)).get("attack", [""])[0]
    if attack == "loop":
        spin()
    if attack == "memory":
        hoard()
    body = json.dumps({"handler": "hostile", "language": "python", "attack": attack})
    return facegate.pipeline.Reply(status=200, headers=[("content-type", "application/json")], body=body.encode())


class IncomingHandler(exports.IncomingHandler):
    def handle(self, request, response_out):
        facegate.serve(request, response_out, answer)
