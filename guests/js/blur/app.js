/**
 * facegate handler `blur`, in JavaScript: POST an image (the raw body or the
 * form field `image`), get it back as a JPEG with every face blurred.
 *
 * Query parameters: those of `detect` (`threshold`, `max_faces`, `size`),
 * plus `quality` (JPEG quality 1..=100, default 85) and `margin` (how much
 * to grow each box before blurring, as a fraction of its size, 0..=1,
 * default 0.1). The answer is `image/jpeg` with `X-Faces` (the count) and
 * `Server-Timing`; errors are `{"error":{"code","message"}}`.
 *
 * The work is done by the pipeline the gateway links in at deploy time
 * (`facegate:face-detect/pipeline`): answers and errors are those of the
 * Rust example `guests/blur`, byte for byte.
 *
 * Build: deploy/scripts/build-js.sh guests/js/blur blur.wasm
 */

import { pipeline, serve } from "facegate";

/** The `wasi:http` export: the request goes to `pipeline.blur` as it is. */
export const incomingHandler = {
  handle(request, responseOut) {
    return serve(request, responseOut, pipeline.blur);
  },
};
