/**
 * facegate handler `detect-cached`, in JavaScript: `detect`, with its
 * answers kept in the tenant's state (`wasi:keyvalue`, bucket
 * `detect-cache`) by the SHA-256 of the request's body, its query and the
 * setting `min_score`, so a repeated image is answered without calling
 * `infer` (no device time, none billed).
 *
 * Takes what `detect` takes and answers what it answers (a hit: the JSON
 * body kept from the first answer), with the header `x-facegate-cache: hit`
 * or `miss`. The cache never fails a request: an answer that could not be
 * kept (a limit of the tenant's state, say) still goes out, with
 * `x-facegate-cache-error` saying why.
 *
 * Build: deploy/scripts/build-js.sh guests/js/detect-cached detect-cached-js.wasm
 */

import { Bucket, StateError, pipeline, queryOf, serve, setting, sha256Hex } from "facegate";

const BUCKET = "detect-cache";
const encoder = new TextEncoder();

/** What shapes the answer: the body, the query and the default threshold. */
function cacheKey(request) {
  const query = sha256Hex(encoder.encode(queryOf(request))).slice(0, 16);
  return `${sha256Hex(request.body)}/${query}/${setting("min_score", "")}`;
}

/** An ASCII header value. */
function oneLine(text) {
  return text.replace(/[^\x20-\x7e]/g, "?");
}

function answer(request) {
  const key = cacheKey(request);
  let cache;
  let kept;
  try {
    cache = new Bucket(BUCKET);
    kept = cache.get(key);
  } catch (error) {
    if (!(error instanceof StateError)) throw error;
  }
  if (kept !== undefined) {
    const headers = [["content-type", "application/json"], ["x-facegate-cache", "hit"]];
    return { status: 200, headers, body: kept };
  }
  const reply = pipeline.detect(request);
  if (reply.status === 200 && cache !== undefined) {
    try {
      cache.set(key, reply.body);
    } catch (error) {
      if (!(error instanceof StateError)) throw error;
      reply.headers.push(["x-facegate-cache-error", oneLine(error.message)]);
    }
  }
  reply.headers.push(["x-facegate-cache", "miss"]);
  return reply;
}

/** The `wasi:http` export. */
export const incomingHandler = {
  handle(request, responseOut) {
    return serve(request, responseOut, answer);
  },
};
