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

function answer(request) {
  const attack = new URLSearchParams(queryOf(request)).get("attack") ?? "";
  if (attack === "loop") spin();
  if (attack === "memory") hoard();
  const body = JSON.stringify({ handler: "hostile", language: "javascript", attack });
  return { status: 200, headers: [["content-type", "application/json"]], body: new TextEncoder().encode(body) };
}

export const incomingHandler = {
  handle(request, responseOut) {
    return serve(request, responseOut, answer);
  },
};
