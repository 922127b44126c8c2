"""facegate handler `faces`, in Python: one component, several routes.
Mounted at `/v1/<tenant>/<handler>`, it sees the path relative to its mount
(the whole path under a tenant's own hostname) and routes on it exactly:

- `GET /health`: `200 {"status":"ok"}`.
- `POST /detect`: what the `detect` example answers (faces as JSON).
- `POST /blur`: what the `blur` example answers (the image as JPEG with
  every face blurred).

Any other path is a 404 `not_found` JSON error; another method on one of
these paths a 405 `method_not_allowed` with `Allow`. Answers and errors are
those of the Rust example `guests/faces`, byte for byte (the pipeline checks
`/detect`'s and `/blur`'s method itself).

Build: deploy/scripts/build-python.sh guests/python/faces faces-py.wasm
"""

import facegate
from facegate import pipeline
from wit_world import exports


def health(request: pipeline.ImageRequest) -> pipeline.Reply:
    """`GET /health`."""
    if request.method != "GET":
        reply = facegate.error_reply(405, "method_not_allowed", f"method {request.method} is not allowed; use GET")
        reply.headers.append(("allow", "GET"))
        return reply
    return pipeline.Reply(status=200, headers=[("content-type", "application/json")], body=b'{"status":"ok"}')


# Each path's answer function.
ROUTES = {
    "/health": health,
    "/detect": pipeline.detect,
    "/blur": pipeline.blur,
}


def route(request: pipeline.ImageRequest) -> pipeline.Reply:
    """The answer for a request: its route's, or a 404."""
    path = facegate.path_of(request)
    answer = ROUTES.get(path)
    if answer is None:
        return facegate.error_reply(
            404, "not_found", f"no route for {path}; the routes are GET /health, POST /detect and POST /blur"
        )
    return answer(request)


class IncomingHandler(exports.IncomingHandler):
    """The `wasi:http` export."""

    def handle(self, request, response_out):
        facegate.serve(request, response_out, route)
