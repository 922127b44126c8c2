/**
 * facegate handler `detect-cached`, in JavaScript: `detect`, with its
 * answers kept in the tenant's state (`wasi:keyvalue`, bucket
 * `detect-cache`), so a repeated image is answered without calling `infer`
 * (no device time, none billed).
 *
 * The key is what shapes the answer: the SHA-256 of the body, its content
 * type, the query and the settings `min_score` and `model`, under a prefix that names
 * this code's version of the answer (`detect-v2`): a change that changes
 * answers bumps it. A hit answers the JSON body kept from the first answer
 * (its `timings_ms` those of the first), with `x-facegate-cache: hit`; a
 * first image `miss`. Only a `POST` is looked up: anything else gets the
 * pipeline's own refusal. The cache never fails a request: an answer that
 * could not be kept (a limit of the tenant's state, say) still goes out,
 * with `x-facegate-cache-error` saying why. Entries stay until deleted
 * (`facegate kv delete --tenant T detect-cache --all`), and count against
 * the tenant's `kv_keys` and `kv_bytes`. The SHA-256 runs in JavaScript
 * (see guest-sdk/js/sha256.js): a large body costs its time on every request.
 *
 * Build: deploy/scripts/build-js.sh guests/js/detect-cached detect-cached-js.wasm
 */

import { Bucket, StateError, pipeline, queryOf, serve, setting, sha256Hex } from "facegate";

const BUCKET = "detect-cache";
/** Names the answer's shape: bumped when this code answers differently. */
const VERSION = "detect-v2";
const encoder = new TextEncoder();

function header(request, name) {
  const found = request.headers.find(([key]) => key.toLowerCase() === name);
  return found ? new TextDecoder().decode(found[1]) : "";
}

/** What shapes the answer: the body, its type, the query and the default threshold. */
function cacheKey(request) {
  const shape = JSON.stringify([header(request, "content-type"), queryOf(request), setting("min_score", ""), setting("model", "")]);
  return `${VERSION}/${sha256Hex(request.body)}/${sha256Hex(encoder.encode(shape))}`;
}

/** `reply`, saying why it was not kept. */
function keptError(reply, error) {
  reply.headers.push(["x-facegate-cache-error", error.message.replace(/[^\x20-\x7e]/g, "?")]);
  return reply;
}

function answer(request) {
  if (request.method !== "POST") {
    return pipeline.detect(request);
  }
  const key = cacheKey(request);
  let cache;
  try {
    cache = new Bucket(BUCKET);
  } catch (error) {
    if (!(error instanceof StateError)) throw error;
    const reply = keptError(pipeline.detect(request), error);
    reply.headers.push(["x-facegate-cache", "miss"]);
    return reply;
  }
  try {
    let kept;
    try {
      kept = cache.get(key);
    } catch (error) {
      if (!(error instanceof StateError)) throw error;
    }
    if (kept !== undefined) {
      return { status: 200, headers: [["content-type", "application/json"], ["x-facegate-cache", "hit"]], body: kept };
    }
    const reply = pipeline.detect(request);
    if (reply.status === 200) {
      try {
        cache.set(key, reply.body);
      } catch (error) {
        if (!(error instanceof StateError)) throw error;
        keptError(reply, error);
      }
    }
    reply.headers.push(["x-facegate-cache", "miss"]);
    return reply;
  } finally {
    // Given back now: an instance that holds it is not kept warm.
    cache.close();
  }
}

/** The `wasi:http` export. */
export const incomingHandler = {
  handle(request, responseOut) {
    return serve(request, responseOut, answer);
  },
};
