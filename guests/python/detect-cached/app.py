"""facegate handler `detect-cached`, in Python: `detect`, with its answers
kept in the tenant's state (`wasi:keyvalue`, bucket `detect-cache`), so a
repeated image is answered without calling `infer` (no device time, none
billed).

The key is what shapes the answer: the SHA-256 of the body, its content
type, the query and the settings `min_score` and `model`, under a prefix that names
this code's version of the answer (`detect-v2`): a change that changes
answers bumps it. A hit answers the JSON body kept from the first answer
(its `timings_ms` those of the first), with `x-facegate-cache: hit`; a
first image `miss`. Only a `POST` is looked up: anything else gets the
pipeline's own refusal. The cache never fails a request: an answer that
could not be kept (a limit of the tenant's state, say) still goes out,
with `x-facegate-cache-error` saying why. Entries stay until deleted
(`facegate kv delete --tenant T detect-cache --all`), and count against
the tenant's `kv_keys` and `kv_bytes`.

Build: deploy/scripts/build-python.sh guests/python/detect-cached detect-cached-py.wasm
"""

import hashlib

import facegate
from facegate import pipeline
from wit_world import exports

BUCKET = "detect-cache"
# Names the answer's shape: bumped when this code answers differently.
VERSION = "detect-v2"


def header(request: pipeline.ImageRequest, name: str) -> bytes:
    for key, value in request.headers:
        if key.lower() == name:
            return value
    return b""


def cache_key(request: pipeline.ImageRequest) -> str:
    """What shapes the answer: the body, its type, the query and the default threshold."""
    shape = hashlib.sha256()
    for part in (header(request, "content-type"), facegate.query_of(request).encode(), facegate.setting("min_score", "").encode(), facegate.setting("model", "").encode()):
        shape.update(len(part).to_bytes(8, "big") + part)
    return f"{VERSION}/{hashlib.sha256(request.body).hexdigest()}/{shape.hexdigest()}"


def kept_error(reply: pipeline.Reply, error: "facegate.StateError") -> pipeline.Reply:
    """`reply`, saying why it was not kept."""
    reply.headers.append(("x-facegate-cache-error", str(error).encode("ascii", "replace").decode()))
    return reply


def answer(request: pipeline.ImageRequest) -> pipeline.Reply:
    if request.method != "POST":
        return pipeline.detect(request)
    key = cache_key(request)
    try:
        cache = facegate.Bucket(BUCKET)
    except facegate.StateError as e:
        reply = kept_error(pipeline.detect(request), e)
        reply.headers.append(("x-facegate-cache", "miss"))
        return reply
    with cache:
        try:
            kept = cache.get(key)
        except facegate.StateError:
            kept = None
        if kept is not None:
            headers = [("content-type", "application/json"), ("x-facegate-cache", "hit")]
            return pipeline.Reply(status=200, headers=headers, body=kept)
        reply = pipeline.detect(request)
        if reply.status == 200:
            try:
                cache.set(key, reply.body)
            except facegate.StateError as e:
                kept_error(reply, e)
    reply.headers.append(("x-facegate-cache", "miss"))
    return reply


class IncomingHandler(exports.IncomingHandler):
    """The `wasi:http` export."""

    def handle(self, request, response_out):
        facegate.serve(request, response_out, answer)
