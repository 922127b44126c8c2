"""facegate handler `hostile`, in Python: a deliberately misbehaving handler.

**A test program, never seeded nor deployed for users.** The gateway's
tests install it to prove that the sandbox holds a Python handler too.

Any method; the query parameter `attack` picks the misbehaviour:

| `attack` | what the handler does                                | expected host outcome      |
|----------|------------------------------------------------------|----------------------------|
| `loop`   | spins forever in pure computation                    | request deadline (timeout) |
| `memory` | allocates and fills 1 MiB chunks forever, keeps them | memory-limit trap          |
| `network`| a TCP and a UDP socket, a name lookup: wasi:sockets  | 200, JSON of each outcome  |
|          | called through its bindings (see `world.wit`)        |                            |
| other    | nothing: answers 200 with a small JSON               | 200                        |
"""

import json
from urllib.parse import parse_qs

import facegate
from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import instance_network, ip_name_lookup, network, tcp_create_socket, udp_create_socket

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


def outcome(call):
    """``ok`` if ``call`` succeeded, else the wasi:sockets error code it got
    (``access-denied``, as the WIT names it)."""
    try:
        call()
    except Err as e:
        return e.value.name.lower().replace("_", "-")
    return "ok"


def sockets():
    """What wasi:sockets gives the handler, called through its bindings:
    creating a TCP and a UDP socket, resolving a name."""
    ipv4 = network.IpAddressFamily.IPV4
    return {
        "tcp": outcome(lambda: tcp_create_socket.create_tcp_socket(ipv4)),
        "udp": outcome(lambda: udp_create_socket.create_udp_socket(ipv4)),
        "lookup": outcome(lambda: ip_name_lookup.resolve_addresses(instance_network.instance_network(), "localhost")),
    }


def answer(request):
    query = parse_qs(facegate.query_of(request))
    attack = query.get("attack", [""])[0]
    if attack == "loop":
        spin()
    if attack == "memory":
        hoard()
    outcomes = sockets() if attack == "network" else {}
    body = json.dumps({"handler": "hostile", "language": "python", "attack": attack, "outcomes": outcomes})
    return facegate.pipeline.Reply(status=200, headers=[("content-type", "application/json")], body=body.encode())


class IncomingHandler(exports.IncomingHandler):
    def handle(self, request, response_out):
        facegate.serve(request, response_out, answer)
