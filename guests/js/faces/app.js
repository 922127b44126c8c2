/**
 * facegate handler `faces`, in JavaScript: one component, several routes.
 * Mounted at `/v1/<tenant>/<handler>`, it sees the path relative to its
 * mount (the whole path under a tenant's own hostname) and routes on it
 * exactly:
 *
 * - `GET /health`: `200 {"status":"ok"}`.
 * - `POST /detect`: what the `detect` example answers (faces as JSON).
 * - `POST /blur`: what the `blur` example answers (the image as JPEG with
 *   every face blurred).
 *
 * Any other path is a 404 `not_found` JSON error; another method on one of
 * these paths a 405 `method_not_allowed` with `Allow`. Answers and errors
 * are those of the Rust example `guests/faces`, byte for byte (the
 * pipeline checks `/detect`'s and `/blur`'s method itself).
 *
 * Build: deploy/scripts/build-js.sh guests/js/faces faces-js.wasm
 */

import { errorReply, jsonReply, pathOf, pipeline, serve } from "facegate";

/** Each path's answer function. */
const ROUTES = new Map([
  ["/health", health],
  ["/detect", pipeline.detect],
  ["/blur", pipeline.blur],
]);

/** `GET /health`. */
function health(request) {
  if (request.method !== "GET") {
    const reply = errorReply(405, "method_not_allowed", `method ${request.method} is not allowed; use GET`);
    reply.headers.push(["allow", "GET"]);
    return reply;
  }
  return jsonReply(200, { status: "ok" });
}

/** The answer for a request: its route's, or a 404. */
function route(request) {
  const path = pathOf(request);
  const answer = ROUTES.get(path);
  if (answer === undefined) {
    return errorReply(404, "not_found", `no route for ${path}; the routes are GET /health, POST /detect and POST /blur`);
  }
  return answer(request);
}

/** The `wasi:http` export. */
export const incomingHandler = {
  handle(request, responseOut) {
    return serve(request, responseOut, route);
  },
};
