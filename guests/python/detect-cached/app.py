"""facegate handler `detect-cached`, in Python: `detect`, with its answers
kept in the tenant's state (`wasi:keyvalue`, bucket `detect-cache`) by the
SHA-256 of the request's body, its query and the setting `min_score`, so a
repeated image is answered without calling `infer` (no device time, none
billed).

Takes what `detect` takes and answers what it answers (a hit: the JSON
body kept from the first answer), with the header `x-facegate-cache: hit` or `miss`.
The cache never fails a request: an answer that could not be kept (a
limit of the tenant's state, say) still goes out, with
`x-facegate-cache-error` saying why.

Build: deploy/scripts/build-python.sh guests/python/detect-cached detect-cached-py.wasm
"""

import hashlib

import facegate
from facegate import pipeline
from wit_world import exports

BUCKET = "detect-cache"


def cache_key(request: pipeline.ImageRequest) -> str:
    """What shapes the answer: the body, the query and the default threshold."""
    digest = hashlib.sha256(request.body).hexdigest()
    query = hashlib.sha256(facegate.query_of(request).encode()).hexdigest()[:16]
    min_score = facegate.setting("min_score", "")
    return f"{digest}/{query}/{min_score}"


def answer(request: pipeline.ImageRequest) -> pipeline.Reply:
    key = cache_key(request)
    try:
        cache = facegate.Bucket(BUCKET)
        kept = cache.get(key)
    except facegate.StateError:
        cache, kept = None, None
    if kept is not None:
        headers = [("content-type", "application/json"), ("x-facegate-cache", "hit")]
        return pipeline.Reply(status=200, headers=headers, body=kept)
    reply = pipeline.detect(request)
    if reply.status == 200 and cache is not None:
        try:
            cache.set(key, reply.body)
        except facegate.StateError as e:
            reply.headers.append(("x-facegate-cache-error", str(e).encode("ascii", "replace").decode()))
    reply.headers.append(("x-facegate-cache", "miss"))
    return reply


class IncomingHandler(exports.IncomingHandler):
    """The `wasi:http` export."""

    def handle(self, request, response_out):
        facegate.serve(request, response_out, answer)
