/**
 * facegate handler `detect`, in JavaScript: POST an image (the raw body or
 * the form field `image`), get its faces as JSON.
 *
 * Query parameters: `threshold` (0 < t <= 1, default 0.5), `max_faces`
 * (1..=1000, default 100), `size` (letterbox side, a multiple of 32 in
 * 128..=1536, default 640). The answer is
 * `{"model","image":{"width","height"},"faces":[{"box","score","landmarks"}],"timings_ms"}`
 * with a `Server-Timing` header; errors are `{"error":{"code","message"}}`.
 *
 * The work is done by the pipeline the gateway links in at deploy time
 * (`facegate:face-detect/pipeline`): answers and errors are those of the
 * Rust example `guests/detect`, byte for byte.
 *
 * Build: deploy/scripts/build-js.sh guests/js/detect detect.wasm
 */

import { pipeline, serve } from "facegate";

/** The `wasi:http` export: the request goes to `pipeline.detect` as it is. */
export const incomingHandler = {
  handle(request, responseOut) {
    return serve(request, responseOut, pipeline.detect);
  },
};
