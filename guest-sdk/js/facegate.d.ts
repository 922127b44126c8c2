/**
 * TypeScript declarations of `facegate.js` (the JavaScript SDK) and of the
 * pipeline interface it re-exports (`facegate:face-detect/pipeline` in
 * `wit/face-detect.wit`), as componentize-js binds them: records are plain
 * objects with camelCase fields, `list<u8>` is a `Uint8Array`, `u64` a
 * `bigint`, and an import's `result` error is thrown.
 *
 * Write a handler in TypeScript against these types, compile it to
 * JavaScript (`tsc`, or any bundler that strips types), then build the
 * component with `deploy/scripts/build-js.sh`, as for a JavaScript handler.
 */

/** `wasi:http/types` resources a handler receives (opaque here). */
export type IncomingRequest = object;
export type ResponseOutparam = object;

/** A buffered HTTP request, as the handler received it. */
export interface ImageRequest {
  /** `POST`, `GET`, ... (upper case). */
  method: string;
  /** The path with its query string, e.g. `/v1/acme/detect?threshold=0.6`. */
  pathWithQuery: string;
  /** Header names and values, as received. */
  headers: Array<[string, Uint8Array]>;
  /** The body. */
  body: Uint8Array;
}

/** An HTTP answer the pipeline built. */
export interface Reply {
  /** Status code. */
  status: number;
  /** Header names and values. */
  headers: Array<[string, string]>;
  /** The body. */
  body: Uint8Array;
}

/** Detection options (the query parameters of the Rust `detect`). */
export interface Options {
  /** Lowest score kept, 0 < t <= 1 (default 0.5). */
  threshold: number;
  /** Most faces returned, 1..=1000 (default 100). */
  maxFaces: number;
  /** Letterbox side, a multiple of 32 in 128..=1536 (default 640). */
  size: number;
}

/** One face, in the image's pixels. */
export interface Face {
  /** x1, y1, x2, y2. */
  box: [number, number, number, number];
  /** Confidence, 0..=1. */
  score: number;
  /** Five (x, y) points: eyes, nose, mouth corners. */
  landmarks: Array<[number, number]>;
}

/** The faces found in one image, best first. */
export interface Detections {
  /** Image width, pixels (after EXIF orientation). */
  width: number;
  /** Image height, pixels. */
  height: number;
  faces: Face[];
}

/** Why the pipeline refused: the Rust SDK's status, JSON code and message. */
export interface Failure {
  status: number;
  code: string;
  message: string;
}

/** The standard pipeline, linked in by the gateway at deploy time. */
export declare const pipeline: {
  /** The largest request body the pipeline takes, bytes. */
  maxBodyBytes(): bigint;
  /** What the Rust `detect` example answers: the faces as JSON, or a JSON error. */
  detect(request: ImageRequest): Reply;
  /** What the Rust `blur` example answers: the image as JPEG with every face blurred, or a JSON error. */
  blur(request: ImageRequest): Reply;
  /** Detection options from a query string (without `?`); throws with a `Failure` payload. */
  parseOptions(query: string): Options;
  /** The faces in an image (encoded bytes); throws with a `Failure` payload. */
  detectFaces(image: Uint8Array, options: Options): Detections;
  /** The JSON error answer for `failure`, as the Rust SDK sends it. */
  errorReply(failure: Failure): Reply;
};

/** Bytes asked for per read of the request body. */
export declare const READ_CHUNK: number;
/** Most bytes written per call. */
export declare const WRITE_CHUNK: number;

/** A refusal with an HTTP status, a JSON error code and a message. */
export declare class Refusal extends Error {
  constructor(status: number, code: string, message: string);
  /** The pipeline's `failure` record. */
  readonly failure: Failure;
  /** The refusal for a pipeline `failure` record. */
  static of(failure: Failure): Refusal;
  /** The JSON error answer for this refusal. */
  reply(): Reply;
}

/** The SDK's JSON error answer: `{"error":{"code":code,"message":message}}`. */
export declare function errorReply(status: number, code: string, message: string): Reply;
/** Detection options from a query string without `?`; throws a `Refusal` (400 `invalid_parameter`). */
export declare function parseOptions(query: string): Options;
/** The faces in `image`; throws a `Refusal` with the Rust SDK's status and code. */
export declare function detectFaces(image: Uint8Array, options: Options): Detections;
/** The query string of an `ImageRequest`, without `?` (`""` when none). */
export declare function queryOf(request: ImageRequest): string;
/**
 * The path of an `ImageRequest`, without the query: relative to the
 * handler's mount (`/detect`, `/` for the mount itself).
 */
export declare function pathOf(request: ImageRequest): string;
/** A JSON `Reply`: `status`, `content-type: application/json`, `JSON.stringify(value)`. */
export declare function jsonReply(status: number, value: unknown): Reply;
/**
 * Answers one `wasi:http` request with `answer`; a thrown `Refusal` becomes
 * its JSON error, anything else a 500 `internal` JSON error.
 */
export declare function serve(
  request: IncomingRequest,
  responseOut: ResponseOutparam,
  answer: (request: ImageRequest) => Reply | Promise<Reply>,
): void | Promise<void>;
/** The request as the pipeline's `ImageRequest` (body read up to the pipeline's limit + 1). */
export declare function readRequest(request: IncomingRequest): ImageRequest;
/** Sends a pipeline `Reply` through `responseOut`. */
export declare function writeReply(reply: Reply, responseOut: ResponseOutparam): void;
/** Sends the SDK's JSON error through `responseOut`. */
export declare function sendError(responseOut: ResponseOutparam, status: number, code: string, message: string): void;

/** SHA-256 of `bytes`, as 64 hex digits (synchronous; see sha256.js). */
export function sha256Hex(bytes: Uint8Array): string;

/** The handler's setting (or secret) `name`, or `fallback` when unset; throws a `Refusal` (500 `bad_setting`) when it cannot be read. */
export function setting(name: string, fallback?: string): string | undefined;
/** Every setting of this handler, by name. */
export function settings(): Record<string, string>;

/** Times `Bucket.update` retries a swap that lost a race. */
export const UPDATE_TRIES: number;

/** A state call that failed; `limit`: one of the tenant's or the request's limits refused it. */
export class StateError extends Error {
  constructor(message: string, limit?: boolean);
  /** The error for a `wasi:keyvalue/store` error value (`{tag, val}`). */
  static of(error: { tag: string; val?: string }): StateError;
  readonly limit: boolean;
  /** 507 `state_limit` for a limit, else 500 `state_error`. */
  refusal(): Refusal;
}

/** One of the tenant's buckets (wasi:keyvalue); every call throws a `StateError` when it fails. */
export class Bucket {
  constructor(name: string);
  /** Gives the bucket back to the host now (an instance holding one is not kept warm). */
  close(): void;
  get(key: string): Uint8Array | undefined;
  set(key: string, value: Uint8Array | string): void;
  delete(key: string): void;
  exists(key: string): boolean;
  keys(): string[];
  increment(key: string, delta?: number | bigint): bigint;
  update(key: string, change: (current: Uint8Array | undefined) => Uint8Array | string): Uint8Array;
  getMany(keys: string[]): Array<Uint8Array | undefined>;
  setMany(items: Array<[string, Uint8Array | string]>): void;
  deleteMany(keys: string[]): void;
}
