/**
 * facegate for JavaScript handlers (componentize-js, world `script-handler`).
 *
 * A JavaScript handler is a `wasi:http` component that imports
 * `facegate:face-detect/pipeline`: the standard detection pipeline of the
 * Rust SDK, which the gateway links in at deploy time. The pipeline checks
 * the request and answers it (statuses, headers, JSON errors byte for byte
 * those of the Rust examples); this module only moves bytes between
 * `wasi:http` and the pipeline:
 *
 *     import { pipeline, serve } from "facegate";
 *
 *     export const incomingHandler = {
 *       handle(request, responseOut) {
 *         return serve(request, responseOut, pipeline.detect);
 *       },
 *     };
 *
 * `serve` reads the request (`readRequest`), calls `answer` with the
 * pipeline's `image-request` and writes the `reply` it returns
 * (`writeReply`). An `answer` may throw a `Refusal` (or return
 * `errorReply(...)`) to send the SDK's JSON error
 * `{"error":{"code","message"}}`; `parseOptions` and `detectFaces` give
 * access to the pipeline for handlers that post-process the faces in
 * JavaScript, throwing a `Refusal` as the Rust SDK would refuse.
 *
 * Build with `deploy/scripts/build-js.sh APP OUT.wasm`, which bundles the
 * app with this module (imported as `"facegate"`). Values follow
 * componentize-js's bindings: records are plain objects with camelCase
 * fields (`pathWithQuery`, `maxFaces`), `list<u8>` is a `Uint8Array`, `u64`
 * a `BigInt`; an import's `result` error is thrown as an `Error` whose
 * `payload` is the error value. Nothing here may call an import at module
 * load time (componentize-js runs the module at build time).
 */

import * as pipeline from "facegate:face-detect/pipeline@0.1.0";
import * as config from "wasi:config/store@0.2.0-rc.1";
import * as atomics from "wasi:keyvalue/atomics@0.2.0-draft2";
import * as batch from "wasi:keyvalue/batch@0.2.0-draft2";
import * as kv from "wasi:keyvalue/store@0.2.0-draft2";
import { Fields, OutgoingBody, OutgoingResponse, ResponseOutparam } from "wasi:http/types@0.2.12";
import { sha256Hex } from "./sha256.js";

export { pipeline, sha256Hex };

/** Bytes asked for per read of the request body (the Rust SDK's READ_CHUNK). */
export const READ_CHUNK = 64 * 1024;
/** Most bytes `blocking-write-and-flush` takes per call. */
export const WRITE_CHUNK = 4096;

// How the bindings name a resource's drop (the same expression as theirs).
const dispose = Symbol.dispose || Symbol.for("dispose");
const encoder = new TextEncoder();

/**
 * A refusal with an HTTP status, a JSON error code and a message. Throw it
 * from an `answer` passed to `serve` to send `{"error":{"code","message"}}`
 * with that status (built by the pipeline, as the Rust SDK builds it).
 * `parseOptions` and `detectFaces` throw it with the pipeline's own failure.
 */
export class Refusal extends Error {
  /**
   * @param {number} status HTTP status.
   * @param {string} code JSON error code, e.g. `invalid_parameter`.
   * @param {string} message Human-readable message.
   */
  constructor(status, code, message) {
    super(message);
    this.name = "Refusal";
    /** The pipeline's `failure` record: `{status, code, message}`. */
    this.failure = { status, code, message };
  }

  /** The refusal for a pipeline `failure` record. */
  static of(failure) {
    return new Refusal(failure.status, failure.code, failure.message);
  }

  /** The JSON error answer for this refusal (a pipeline `reply`). */
  reply() {
    return pipeline.errorReply(this.failure);
  }
}

/** The SDK's JSON error answer: `{"error":{"code":code,"message":message}}`. */
export function errorReply(status, code, message) {
  return pipeline.errorReply({ status, code, message });
}

/**
 * Detection options `{threshold, maxFaces, size}` from a query string
 * without `?`; throws a `Refusal` (400 `invalid_parameter`) when one is wrong.
 */
export function parseOptions(query) {
  return refusing(() => pipeline.parseOptions(query));
}

/**
 * The faces in `image` (encoded bytes, a `Uint8Array`): `{width, height,
 * faces: [{box: [x1, y1, x2, y2], score, landmarks: [[x, y], ...]}]}`, best
 * first, in the image's pixels. Throws a `Refusal` when the image is invalid
 * or the detector fails (the Rust SDK's status and code).
 */
export function detectFaces(image, options) {
  return refusing(() => pipeline.detectFaces(image, options));
}

/** The query string of an `image-request`, without `?` (`""` when none). */
export function queryOf(request) {
  const at = request.pathWithQuery.indexOf("?");
  return at < 0 ? "" : request.pathWithQuery.slice(at + 1);
}

/**
 * The path of an `image-request`, without the query (`/detect` for
 * `/detect?threshold=0.6`): what a handler that serves several routes
 * routes on. Mounted at `/v1/<tenant>/<handler>`, a handler sees the path
 * relative to its mount (`/` for the mount itself); under a tenant's own
 * hostname, the whole path.
 */
export function pathOf(request) {
  const at = request.pathWithQuery.indexOf("?");
  return at < 0 ? request.pathWithQuery : request.pathWithQuery.slice(0, at);
}

/** A JSON `reply`: `status`, `content-type: application/json`, `JSON.stringify(value)`. */
export function jsonReply(status, value) {
  return { status, headers: [["content-type", "application/json"]], body: encoder.encode(JSON.stringify(value)) };
}

/**
 * Answers one `wasi:http` request with `answer` (e.g. `pipeline.detect`),
 * which gets the `image-request` and returns a `reply` (or a promise of
 * one: then `serve` returns a promise, which `handle` must return so that
 * componentize-js waits for it). A thrown `Refusal` becomes its JSON
 * error; anything else thrown a 500 `internal` JSON error (and the stack on
 * stderr).
 */
export function serve(request, responseOut, answer) {
  let reply;
  try {
    let read;
    try {
      read = readRequest(request);
    } finally {
      // Dropped as soon as it is read, not whenever the GC gets to it: an
      // instance that still holds its request is never reused (warm instances).
      request[dispose]();
    }
    reply = answer(read);
  } catch (error) {
    reply = replyFor(error);
  }
  if (reply && typeof reply.then === "function") {
    return reply.then(
      (value) => writeReply(value, responseOut),
      (error) => writeReply(replyFor(error), responseOut),
    );
  }
  writeReply(reply, responseOut);
}

/**
 * The request as the pipeline's `image-request`: `{method, pathWithQuery,
 * headers, body}`: method upper case, path with query (`/` when absent),
 * headers as received, the body.
 *
 * The body is read in chunks and no further than `maxBodyBytes() + 1`
 * bytes, so that the pipeline answers 413 for a larger one; when
 * `Content-Length` already announces more than `maxBodyBytes()`, it is not
 * read at all (the pipeline answers 413 from the header, as the Rust SDK
 * does). Checks nothing else: the pipeline does.
 *
 * Throws a `Refusal` (400 `body_read_failed`) when the body cannot be
 * read, with the Rust SDK's message.
 */
export function readRequest(request) {
  const method = request.method();
  const name = method.tag === "other" ? method.val.toUpperCase() : method.tag.toUpperCase();
  const path = request.pathWithQuery();
  const fields = request.headers(); // a child of `request`: dropped first
  const headers = fields.entries();
  fields[dispose]();
  const limit = Number(pipeline.maxBodyBytes());
  const announced = contentLength(headers);
  const body = announced !== undefined && announced > limit ? new Uint8Array(0) : readBody(request, limit + 1);
  return { method: name, pathWithQuery: path ?? "/", headers, body };
}

/**
 * Sends a pipeline `reply` through `responseOut`: its status, its headers
 * plus `content-length` (as the Rust SDK's `Response::send`), then its body
 * in writes of at most 4096 bytes, then finishes the body.
 *
 * Errors after the status is sent (the client went away) are logged to
 * stderr, as the Rust SDK does.
 */
export function writeReply(reply, responseOut) {
  const entries = reply.headers.map(([name, value]) => [name, encoder.encode(value)]);
  if (!reply.headers.some(([name]) => name.toLowerCase() === "content-length")) {
    entries.push(["content-length", encoder.encode(String(reply.body.length))]);
  }
  let headers;
  try {
    headers = Fields.fromList(entries);
  } catch (error) {
    log(`invalid response header (${describe(error)}); sending none`);
    headers = new Fields();
  }
  const response = new OutgoingResponse(headers);
  try {
    response.setStatusCode(reply.status);
  } catch {
    log(`invalid status ${reply.status}; sending 200`);
  }
  const body = response.body();
  // The response goes out first: its body is consumed as it is written.
  ResponseOutparam.set(responseOut, { tag: "ok", val: response });
  try {
    const stream = body.write();
    try {
      for (let start = 0; start < reply.body.length; start += WRITE_CHUNK) {
        stream.blockingWriteAndFlush(reply.body.subarray(start, start + WRITE_CHUNK));
      }
    } finally {
      stream[dispose](); // must be gone before `finish`
    }
    OutgoingBody.finish(body, undefined);
  } catch (error) {
    log(`writing the response body failed: ${describe(error)}`);
  }
}

/** Answers with the SDK's JSON error (see `errorReply`). */
export function sendError(responseOut, status, code, message) {
  writeReply(errorReply(status, code, message), responseOut);
}

/** The reply for an error thrown by an `answer`. */
function replyFor(error) {
  if (error instanceof Refusal) {
    return error.reply();
  }
  if (error instanceof StateError) {
    return error.refusal().reply();
  }
  console.error(`${error}${error && error.stack ? `\n${error.stack}` : ""}`);
  const kind = error && error.name ? error.name : typeof error;
  return errorReply(500, "internal", `the handler failed: ${kind}`);
}

/** Runs `call`, turning a pipeline `failure` it throws into a `Refusal`. */
function refusing(call) {
  try {
    return call();
  } catch (error) {
    const failure = error && error.payload;
    if (failure && typeof failure.status === "number" && typeof failure.code === "string") {
      throw Refusal.of(failure);
    }
    throw error;
  }
}

/** The `Content-Length` header's value, if present and a number. */
function contentLength(headers) {
  for (const [name, value] of headers) {
    if (name.toLowerCase() === "content-length") {
      const text = new TextDecoder().decode(value).trim();
      return /^[0-9]+$/.test(text) ? Number(text) : undefined;
    }
  }
  return undefined;
}

/** At most `most` bytes of the body; fewer when it ends sooner. */
function readBody(request, most) {
  const failed = (what) => new Refusal(400, "body_read_failed", `the body could not be read: ${what}`);
  let incoming;
  try {
    incoming = request.consume();
  } catch {
    throw failed("the body was already consumed");
  }
  const chunks = [];
  let length = 0;
  try {
    let stream;
    try {
      stream = incoming.stream();
    } catch {
      throw failed("the body stream was already taken");
    }
    try {
      while (length < most) {
        let chunk;
        try {
          chunk = stream.blockingRead(BigInt(Math.min(READ_CHUNK, most - length)));
        } catch (error) {
          const payload = error && error.payload;
          if (payload && payload.tag === "closed") {
            break;
          }
          if (payload && payload.tag === "last-operation-failed") {
            const message = payload.val.toDebugString();
            payload.val[dispose]();
            throw failed(message);
          }
          throw error;
        }
        chunks.push(chunk);
        length += chunk.length;
      }
    } finally {
      stream[dispose](); // a child of `incoming`: dropped first
    }
  } finally {
    incoming[dispose]();
  }
  const body = new Uint8Array(length);
  let offset = 0;
  for (const chunk of chunks) {
    body.set(chunk, offset);
    offset += chunk.length;
  }
  return body;
}

function describe(error) {
  const payload = error && error.payload;
  if (payload === undefined) {
    return String(error);
  }
  return typeof payload === "object" && payload !== null && "tag" in payload ? payload.tag : JSON.stringify(payload);
}

function log(message) {
  console.error(`facegate (js): ${message}`);
}

// -- Settings and secrets (wasi:config/store) --------------------------------

/**
 * The handler's setting (or secret) `name`, as the request started
 * (`facegate config set`, `facegate secret set`: the handler's own over its
 * tenant's), or `fallback` when it is not set. Throws a `Refusal` (500
 * `bad_setting`) when the host cannot read it (a secret it cannot open); the
 * message names the setting, never its value.
 * @param {string} name
 * @param {string} [fallback]
 * @returns {string | undefined}
 */
export function setting(name, fallback) {
  let value;
  try {
    value = config.get(name);
  } catch {
    throw new Refusal(500, "bad_setting", `the setting ${JSON.stringify(name)} cannot be read`);
  }
  return value === undefined ? fallback : value;
}

/** Every setting of this handler, as an object by name (see `setting`). */
export function settings() {
  try {
    return Object.fromEntries(config.getAll());
  } catch {
    throw new Refusal(500, "bad_setting", "the settings cannot be read");
  }
}

// -- State (wasi:keyvalue) -----------------------------------------------------

/** Times `Bucket.update` retries a swap that lost a race. */
export const UPDATE_TRIES = 16;
/** The names a limit's refusal carries, as the host words it. */
const LIMITS = ["(kv_keys)", "(kv_bytes)", "(kv_value_bytes)", "(kv_ops)"];

/**
 * A state call that failed. `limit` is true when one of the tenant's or the
 * request's limits refused it (`kv_keys`, `kv_bytes`, `kv_value_bytes`,
 * `kv_ops`: the message names it). `refusal()`: 507 `state_limit`, else 500
 * `state_error`, as the Rust SDK answers.
 */
export class StateError extends Error {
  constructor(message, limit = false) {
    super(message);
    this.name = "StateError";
    this.limit = limit;
  }

  /** The error for a `wasi:keyvalue/store` error value. */
  static of(error) {
    switch (error && error.tag) {
      case "no-such-store":
        return new StateError("the tenant's state cannot be reached: no such store");
      case "access-denied":
        return new StateError("the tenant's state cannot be reached: access denied (the tenant was deleted)");
      default: {
        const message = error && typeof error.val === "string" ? error.val : String(error);
        // The host names the limit a refusal is for, as "(kv_keys)" and the like.
        return new StateError(message, LIMITS.some((name) => message.includes(name)));
      }
    }
  }

  /** This error as the JSON error a handler answers with. */
  refusal() {
    return this.limit ? new Refusal(507, "state_limit", this.message) : new Refusal(500, "state_error", this.message);
  }
}

/** Runs `call`, turning a store error it throws into a `StateError`. */
function stateful(call) {
  try {
    return call();
  } catch (error) {
    if (error && error.payload !== undefined) {
      throw StateError.of(error.payload);
    }
    throw error;
  }
}

/**
 * One of the tenant's buckets: keys and values the gateway keeps in its
 * database, read by every request on every node after this one. A bucket is
 * a name (1 to 64 ASCII letters, digits, `.`, `_`, `-`) within the tenant.
 * Values are `Uint8Array`s (strings are stored as UTF-8). Every call throws
 * a `StateError` when it fails.
 */
export class Bucket {
  /** @param {string} name */
  constructor(name) {
    this.bucket = stateful(() => kv.open(name));
  }

  /**
   * Gives the bucket back to the host now: an instance still holding one
   * (until the garbage collector finds it) is not kept warm for the next
   * request. Also `[Symbol.dispose]`, for `using`.
   */
  close() {
    if (this.bucket !== undefined) {
      this.bucket[dispose]();
      this.bucket = undefined;
    }
  }

  [dispose]() {
    this.close();
  }

  /** The value of `key`, `undefined` if it has none. */
  get(key) {
    return stateful(() => this.bucket.get(key));
  }

  /** Sets `key` to `value` (a `Uint8Array` or a string). */
  set(key, value) {
    const bytes = typeof value === "string" ? encoder.encode(value) : value;
    stateful(() => this.bucket.set(key, bytes));
  }

  /** Deletes `key` (a missing key is no error). */
  delete(key) {
    stateful(() => this.bucket.delete(key));
  }

  /** Whether `key` has a value. */
  exists(key) {
    return stateful(() => this.bucket.exists(key));
  }

  /** Every key, in byte order (each page of 100 one of the request's `kv_ops`). */
  keys() {
    const found = [];
    let cursor;
    do {
      const page = stateful(() => this.bucket.listKeys(cursor));
      found.push(...page.keys);
      cursor = page.cursor;
    } while (cursor !== undefined);
    return found;
  }

  /**
   * Adds `delta` to the counter `key` (decimal text; a missing key counts
   * from 0), atomically across every request on every node; the new value.
   * @param {string} key
   * @param {number | bigint} [delta]
   * @returns {bigint}
   */
  increment(key, delta = 1) {
    return stateful(() => atomics.increment(this.bucket, key, BigInt(delta)));
  }

  /**
   * Replaces `key`'s value with `change(current)` atomically
   * (compare-and-swap, retried with the fresh value up to `UPDATE_TRIES`
   * times); the value written.
   */
  update(key, change) {
    let cas = stateful(() => atomics.Cas.new(this.bucket, key));
    try {
      for (let i = 0; i < UPDATE_TRIES; i++) {
        const current = stateful(() => cas.current());
        const next = change(current);
        const value = typeof next === "string" ? encoder.encode(next) : next;
        // `swap` takes the handle: a failure hands a fresh one back.
        const owned = cas;
        cas = undefined;
        try {
          atomics.swap(owned, value);
          return value;
        } catch (error) {
          const payload = error && error.payload;
          if (payload && payload.tag === "cas-failed") {
            cas = payload.val;
            continue;
          }
          if (payload && payload.tag === "store-error") {
            throw StateError.of(payload.val);
          }
          throw error;
        }
      }
      throw new StateError(`${JSON.stringify(key)} changed under ${UPDATE_TRIES} tries to update it`);
    } finally {
      if (cas !== undefined) cas[dispose]();
    }
  }

  /** The values of `keys`, in order (`undefined`: no value). */
  getMany(keys) {
    return stateful(() => batch.getMany(this.bucket, keys)).map((pair) => (pair === undefined ? undefined : pair[1]));
  }

  /** Sets every `[key, value]` of `items`, all or none. */
  setMany(items) {
    const bytes = items.map(([key, value]) => [key, typeof value === "string" ? encoder.encode(value) : value]);
    stateful(() => batch.setMany(this.bucket, bytes));
  }

  /** Deletes every key of `keys`. */
  deleteMany(keys) {
    stateful(() => batch.deleteMany(this.bucket, keys));
  }
}
