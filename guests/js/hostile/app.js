/**
 * facegate handler `hostile`, in JavaScript: a deliberately misbehaving
 * handler.
 *
 * **A test program, never seeded nor deployed for users.** The gateway's
 * tests install it to prove that the sandbox holds a JavaScript handler too.
 *
 * Any method; the query parameter `attack` picks the misbehaviour:
 *
 * | `attack` | what the handler does                                | expected host outcome      |
 * |----------|------------------------------------------------------|----------------------------|
 * | `loop`   | spins forever in pure computation                    | request deadline (timeout) |
 * | `memory` | allocates and fills 1 MiB chunks forever, keeps them | memory-limit trap          |
 * | `network`| `fetch` of http://127.0.0.1:`port`/healthz           | 200, JSON of the outcome   |
 * | other    | nothing: answers 200 with a small JSON               | 200                        |
 */

import { queryOf, serve } from "facegate";

const MIB = 1 << 20;

/** Counts forever. */
function spin() {
  let counter = 0;
  for (;;) {
    counter = (counter + 1) | 0;
  }
}

/** Keeps 1 MiB chunks, every byte written, until the host stops it. */
function hoard() {
  const chunks = [];
  for (;;) {
    chunks.push(new Uint8Array(MIB).fill(0xa5));
  }
}

/** Fetches the gateway's own health check; reports what it came to. */
async function network(port) {
  try {
    const response = await fetch(`http://127.0.0.1:${port}/healthz`);
    return { fetch: `answered ${response.status}` };
  } catch (error) {
    return { fetch: `refused: ${error}` };
  }
}

function reply(attack, outcomes) {
  const body = JSON.stringify({ handler: "hostile", language: "javascript", attack, outcomes });
  return { status: 200, headers: [["content-type", "application/json"]], body: new TextEncoder().encode(body) };
}

function answer(request) {
  const query = new URLSearchParams(queryOf(request));
  const attack = query.get("attack") ?? "";
  if (attack === "loop") spin();
  if (attack === "memory") hoard();
  if (attack === "network") return network(query.get("port") ?? "80").then((outcomes) => reply(attack, outcomes));
  return reply(attack, {});
}

export const incomingHandler = {
  handle(request, responseOut) {
    return serve(request, responseOut, answer);
  },
};
