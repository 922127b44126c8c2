//! facegate handler `hostile`: a deliberately misbehaving handler.
//!
//! **A test program, never deployed for users.** The host's integration
//! tests install it to prove that the sandbox holds: a runaway, greedy,
//! crashing or nosy handler ends its own request only, sees nothing of the
//! host, and cannot get malformed tensors or extra calls past `infer`.
//!
//! Any method; `?attack=NAME` picks the misbehaviour:
//!
//! | `attack`      | what the handler does                                      | expected host outcome       |
//! |---------------|------------------------------------------------------------|-----------------------------|
//! | `loop`        | spins forever in pure computation                          | request deadline (timeout)  |
//! | `memory`      | allocates and fills 1 MiB chunks forever, keeping them     | memory-limit trap           |
//! | `recursion`   | recurses (not a tail call) without end                     | stack-overflow trap         |
//! | `panic`       | `panic!`s (the release profile aborts: `unreachable`)      | trap                        |
//! | `snoop`       | reads files, environment and cwd                           | 200, JSON of what it saw    |
//! | `headers`     | answers the request's headers as it received them          | 200, JSON: name → values    |
//! | `echo`        | answers what it was asked: method, path, query, headers     | 200, JSON                   |
//! | `sockets`     | opens a TCP and a UDP socket, resolves a name (wasi:sockets) | 200, JSON of each outcome |
//! | `bad-tensor`  | calls `face-detect.infer` with malformed tensors           | 200, JSON of each outcome   |
//! | `many-calls`  | calls `infer` 100 times with a valid tensor                | 200, JSON: successes, error |
//! | `fields`      | keeps ever more header `fields`, `per` (default 8) 4 KiB headers each | 500 `resource_limit` |
//! | `bodies`      | keeps ever more response bodies, each with a written chunk | 500 `resource_limit`        |
//! | `pollables`   | keeps ever more clock pollables                            | 500 `resource_limit`        |
//! | `random`      | asks `wasi:random` for 64 MiB at once                      | 500 `resource_limit`        |
//! | `random-loop` | asks `wasi:random` for 1 MiB (the cap) over and over       | request deadline (timeout)  |
//! | `stderr`      | writes 64 MiB of forged log lines to stderr, then answers  | 200 (output dropped)        |
//! | `sleep`       | blocks on a clock past any deadline                        | request deadline (timeout)  |
//! | `big-tensor`  | `n` (default 1) `infer` calls of `model` with a `side`² zero image | 200, JSON of each outcome   |
//! | `count`       | counts its requests in a global                            | 200, `{"served": n}`: 1 in a fresh instance |
//! | `leak`        | counts, and leaves a header `fields` in the host's table   | 200, `{"served": n}`; the instance is not reused |
//! | `nap`         | sleeps `ms` (default 100, at most 10000), then counts      | 200, `{"served": n}`             |
//! | `hold`        | fills `mib` MiB (default 240) of memory, holds it `ms` (default 2000, at most 10000) | 200, `{"held_mib": n}`; 503 `overloaded` past the node's memory budget |
//! | `inspect`     | grows its memory by `mib` (default 16, at most 64) MiB and counts the bytes of the new pages that are not zero | 200, `{"nonzero": 0}`: nothing of an earlier instance's memory (`hold` writes 0xA5) |
//! | `error-code`  | answers with a wasi:http `internal-error` whose message is `mib` (default 8) MiB of control bytes | 500 `handler_failed`, the message cut |
//! | `fetch`       | an outgoing `GET` of `url` (`http://host:port/path`)       | 200, JSON: `ok: STATUS` or the error code |
//! | `fetch-many`  | `n` (default 8, at most 64) outgoing `GET`s of `url`, each sent once the one before has its head, all kept open, then each body read | 200, JSON: how many ended each way (`ok: STATUS` or the error code) |
//! | `lift`        | one `infer` call with `mib` (default 64) MiB of data       | 500 `resource_limit` past the host's per-call cap |
//! | `config`      | reads its setting `name` (wasi:config), or all of them without `name` | 200, JSON: `value` (null when unset) or `all`; `error` when the host could not read it |
//! | `kv-fill`     | writes `bytes` (default 1024) bytes under ever new keys of `bucket` (default `fill`) until a write fails | 200, JSON: `written`, `error` (the limit it met) |
//! | `kv-get`      | reads `key` of `bucket` (wasi:keyvalue)                    | 200, JSON: `value` (text; null when absent) or `error` |
//! | `kv-put`      | writes `value` to `key` of `bucket`                        | 200, JSON: `ok` or `error`  |
//! | `kv-incr`     | adds `by` (default 1) to the counter `key` of `bucket`     | 200, JSON: `value` or `error` |
//! | `kv-list`     | lists the keys of `bucket`                                 | 200, JSON: `keys` or `error` |
//!
//! Any attack also takes `linger=MS` (at most 10000): once its answer is
//! sent in full, the handler keeps running `MS` milliseconds before it
//! returns (work after the answer, which holds the call's slots).
//!
//! `error-code` answers through the `wasi:http` response outparam itself
//! (the SDK's handlers never send an error code), so it is read from the
//! raw query before the SDK sees the request.
//!
//! `bad-tensor` takes `case=NAME` to run one case only (each case uses one
//! of the request's `infer` calls, so a low per-request quota would answer
//! later cases with `quota-exceeded`). A missing or unknown `attack` (or
//! `case`) is a 400 `invalid_parameter`.

use std::hint::black_box;

use facegate_guest_sdk::face_detect::{self, ElementType, Tensor};
use facegate_guest_sdk::http::HttpError;
use facegate_guest_sdk::serde_json::{Value, json};
use facegate_guest_sdk::wasi::http::types::{
    ErrorCode, FutureIncomingResponse, IncomingBody, IncomingRequest, IncomingResponse, ResponseOutparam,
};
use facegate_guest_sdk::{Error, Handler, Request, Response};

/// The attacks, as `attack` accepts them (for the 400 message).
const ATTACKS: &str = "loop, memory, recursion, panic, snoop, headers, bad-tensor, many-calls, \
                       fields, bodies, pollables, random, random-loop, stderr, sleep, big-tensor, sockets, count, leak, nap, hold, inspect, \
                       error-code, lift, fetch, fetch-many, echo, config, kv-fill, kv-get, kv-put, kv-incr, kv-list";
/// The model every facegate host serves.
const MODEL: &str = "centerface";
/// `infer` calls made by `many-calls`.
const MANY_CALLS: usize = 100;
/// One chunk of `memory`.
const MIB: usize = 1 << 20;

/// The handler.
struct Hostile;

impl Handler for Hostile {
    const METHODS: &'static [&'static str] = &["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"];

    fn handle(request: Request) -> Result<Response, Error> {
        let query = request.query();
        let attack = query.get("attack")?.unwrap_or("");
        match attack {
            "loop" => spin(),
            "memory" => hoard(),
            "recursion" => Ok(Response::json(200, &json!({ "depth": recurse(0) }))),
            "panic" => panic!("hostile handler panicked on purpose"),
            "snoop" => Ok(Response::json(200, &snoop())),
            "headers" => Ok(Response::json(200, &headers(&request))),
            "echo" => Ok(Response::json(200, &echo(&request))),
            "sockets" => Ok(Response::json(200, &sockets())),
            "bad-tensor" => bad_tensors(query.get("case")?),
            "many-calls" => Ok(Response::json(200, &many_calls())),
            "fields" => hoard_fields(query.get("per")?),
            "bodies" => hoard_bodies(),
            "pollables" => hoard_pollables(),
            "random" => Ok(Response::json(200, &json!({ "bytes": random(64 * MIB) }))),
            "random-loop" => random_loop(),
            "stderr" => Ok(Response::json(200, &json!({ "written": flood_stderr() }))),
            "sleep" => sleep(),
            "big-tensor" => big_tensors(query.get("side")?, query.get("n")?, query.get("model")?),
            "count" => Ok(Response::json(200, &json!({ "served": count() }))),
            "config" => Ok(Response::json(200, &setting(query.get("name")?))),
            "kv-fill" => Ok(Response::json(200, &kv_fill(query.get("bucket")?.unwrap_or("fill"), query.get("bytes")?))),
            "kv-get" | "kv-put" | "kv-incr" | "kv-list" => Ok(Response::json(200, &kv_call(attack, request.query())?)),
            "leak" => Ok(Response::json(200, &json!({ "served": leak() }))),
            "nap" => nap(query.get("ms")?),
            "hold" => hold(query.get("mib")?, query.get("ms")?),
            "inspect" => inspect(query.get("mib")?),
            "lift" => lift(query.get("mib")?),
            "fetch" => Ok(Response::json(200, &json!({ "outcome": fetch(query.get("url")?.unwrap_or("")) }))),
            "fetch-many" => fetch_many(query.get("url")?.unwrap_or(""), query.get("n")?),
            other => Err(HttpError::invalid_parameter("attack", &format!("must be one of {ATTACKS}, got {other:?}")).into()),
        }
    }
}

impl facegate_guest_sdk::wasi::exports::http::incoming_handler::Guest for Hostile {
    fn handle(request: IncomingRequest, out: ResponseOutparam) {
        let query = request.path_with_query().unwrap_or_default();
        match error_code_mib(&query) {
            Some(mib) => ResponseOutparam::set(out, Err(ErrorCode::InternalError(Some("\u{1}".repeat(mib * MIB))))),
            None => facegate_guest_sdk::http::serve::<Hostile>(request, out),
        }
        if let Some(ms) = query_number(&query, "linger") {
            use facegate_guest_sdk::wasi::clocks::monotonic_clock::subscribe_duration;
            subscribe_duration(ms.min(10_000) * 1_000_000).block();
        }
    }
}

facegate_guest_sdk::wasi::http::proxy::export!(Hostile);

/// For `attack=error-code`: its `mib` (default 8); `None` for other attacks.
fn error_code_mib(path_with_query: &str) -> Option<usize> {
    let error_code = query_pairs(path_with_query).any(|pair| pair == ("attack", "error-code"));
    error_code.then(|| query_number(path_with_query, "mib").map_or(8, |mib| mib as usize))
}

/// The raw query's `key`, when it is a number.
fn query_number(path_with_query: &str, key: &str) -> Option<u64> {
    query_pairs(path_with_query).find(|(k, _)| *k == key)?.1.parse().ok()
}

/// The raw query's `key=value` pairs (read before the SDK sees the request).
fn query_pairs(path_with_query: &str) -> impl Iterator<Item = (&str, &str)> {
    let query = path_with_query.split_once('?').map_or("", |(_, query)| query);
    query.split('&').filter_map(|pair| pair.split_once('='))
}

/// Counts forever; `black_box` keeps the optimiser from removing the loop.
fn spin() -> ! {
    let mut counter: u64 = 0;
    loop {
        counter = black_box(counter.wrapping_add(1));
    }
}

/// Keeps allocating 1 MiB chunks, every byte written, until the host stops it.
fn hoard() -> ! {
    let mut chunks: Vec<Vec<u8>> = Vec::new();
    loop {
        // A non-zero fill writes every page (a zeroed allocation might not).
        chunks.push(black_box(vec![0xA5; MIB]));
        black_box(&chunks);
    }
}

/// Recurses until the stack overflows. The `black_box`ed values are small
/// scalars, so each frame costs more of the wasm (native) stack than of the
/// shadow stack in linear memory: the engine's stack limit trips first.
#[inline(never)]
fn recurse(depth: u64) -> u64 {
    if black_box(depth) == u64::MAX {
        return depth;
    }
    // Work after the call: no tail call, no loop.
    black_box(recurse(depth + 1)).wrapping_add(1)
}

/// What `wasi:sockets` gives the handler: each use's error code, or "ok".
fn sockets() -> Value {
    use facegate_guest_sdk::wasi::sockets::network::IpAddressFamily;
    use facegate_guest_sdk::wasi::sockets::{instance_network, ip_name_lookup, tcp_create_socket, udp_create_socket};
    let code = |result: Result<(), facegate_guest_sdk::wasi::sockets::network::ErrorCode>| match result {
        Ok(()) => "ok".to_owned(),
        Err(e) => e.name().to_owned(),
    };
    json!({
        "tcp": code(tcp_create_socket::create_tcp_socket(IpAddressFamily::Ipv4).map(drop)),
        "udp": code(udp_create_socket::create_udp_socket(IpAddressFamily::Ipv4).map(drop)),
        "lookup": code(ip_name_lookup::resolve_addresses(&instance_network::instance_network(), "localhost").map(drop)),
    })
}

/// What the handler can see of the host: files, environment, cwd.
fn snoop() -> Value {
    json!({
        "files": {
            "read_dir_root": outcome(std::fs::read_dir("/"), |d| format!("{} entries", d.count())),
            "passwd": outcome(std::fs::read("/etc/passwd"), |b| format!("{} bytes", b.len())),
            "cargo_toml": outcome(std::fs::read("./Cargo.toml"), |b| format!("{} bytes", b.len())),
        },
        "env": {
            "count": std::env::vars_os().count(),
            "home": std::env::var_os("HOME").map(|h| h.to_string_lossy().into_owned()),
        },
        "cwd": outcome(std::env::current_dir(), |p| p.display().to_string()),
    })
}

/// The request's headers as the handler received them: each name (as
/// sent to it) with its values, in order.
fn headers(request: &Request) -> Value {
    let mut seen = facegate_guest_sdk::serde_json::Map::new();
    for (name, value) in request.headers() {
        let values = seen.entry(name.clone()).or_insert_with(|| Value::Array(Vec::new()));
        if let Value::Array(values) = values {
            values.push(Value::String(String::from_utf8_lossy(value).into_owned()));
        }
    }
    Value::Object(seen)
}

/// What the guest was asked: method, path (as the host gave it), the
/// decoded query's pairs and the headers.
fn echo(request: &Request) -> Value {
    let query: Vec<Value> = request.query().pairs().iter().map(|(k, v)| json!([k, v])).collect();
    json!({ "method": request.method(), "path": request.path(), "query": query, "headers": headers(request) })
}

/// `"ok: …"` or `"error: …"`.
fn outcome<T, E: std::fmt::Display>(result: Result<T, E>, ok: impl FnOnce(T) -> String) -> String {
    match result {
        Ok(value) => format!("ok: {}", ok(value)),
        Err(e) => format!("error: {e}"),
    }
}

/// A `u8` tensor of `len` zero bytes.
fn u8_tensor(shape: &[u32], len: usize) -> Tensor {
    Tensor { shape: shape.to_vec(), element: ElementType::U8, data: vec![0; len] }
}

/// A valid CenterFace input: `[32, 32, 3]` u8.
fn small_image() -> Tensor {
    u8_tensor(&[32, 32, 3], 32 * 32 * 3)
}

/// The malformed (and one valid) `infer` calls of `bad-tensor`: name,
/// model, input.
fn cases() -> Vec<(&'static str, &'static str, Tensor)> {
    vec![
        ("short_data", MODEL, u8_tensor(&[640, 640, 3], 10)),
        ("empty_shape", MODEL, u8_tensor(&[], 0)),
        ("overflowing_shape", MODEL, u8_tensor(&[u32::MAX, u32::MAX, 3], 3)),
        ("wrong_element", MODEL, Tensor { shape: vec![640, 640, 3], element: ElementType::F32, data: vec![0; 640 * 640 * 3 * 4] }),
        ("bad_side", MODEL, u8_tensor(&[100, 100, 3], 100 * 100 * 3)),
        ("unknown_model", "nope", small_image()),
        ("huge_rank", MODEL, u8_tensor(&vec![1; 1 << 20], 1)),
        ("valid", MODEL, small_image()),
    ]
}

/// Runs every case (or only `only`) and reports each outcome.
fn bad_tensors(only: Option<&str>) -> Result<Response, Error> {
    let mut cases = cases();
    if let Some(name) = only {
        cases.retain(|(case, _, _)| *case == name);
        if cases.is_empty() {
            let names: Vec<_> = self::cases().into_iter().map(|(case, _, _)| case).collect();
            let message = format!("must be one of {}, got {name:?}", names.join(", "));
            return Err(HttpError::invalid_parameter("case", &message).into());
        }
    }
    let results: Vec<Value> = cases
        .into_iter()
        .map(|(case, model, input)| {
            // A million dimensions are not echoed back.
            let shape = if input.shape.len() <= 8 { json!(input.shape) } else { json!(format!("{} dimensions", input.shape.len())) };
            let mut result = json!({ "case": case, "model": model, "shape": shape });
            match face_detect::infer(model, &input) {
                Ok(outputs) => {
                    result["ok"] = true.into();
                    result["outputs"] = outputs.iter().map(|t| json!({ "shape": t.shape, "bytes": t.data.len() })).collect();
                }
                Err(e) => {
                    result["ok"] = false.into();
                    result["error"] = describe(&e).into();
                }
            }
            result
        })
        .collect();
    Ok(Response::json(200, &json!({ "results": results })))
}

/// `infer`s a valid tensor [`MANY_CALLS`] times; counts what got through.
fn many_calls() -> Value {
    let input = small_image();
    let mut succeeded = 0;
    let mut first_error: Option<(usize, String)> = None;
    for call in 1..=MANY_CALLS {
        match face_detect::infer(MODEL, &input) {
            Ok(_) => succeeded += 1,
            Err(e) => {
                first_error.get_or_insert_with(|| (call, describe(&e)));
            }
        }
    }
    json!({
        "calls": MANY_CALLS,
        "succeeded": succeeded,
        "failed": MANY_CALLS - succeeded,
        "first_error_call": first_error.as_ref().map(|(call, _)| call),
        "first_error": first_error.map(|(_, error)| error),
    })
}

/// The WIT error as `case-name: message` (`overloaded` has no message).
fn describe(error: &face_detect::Error) -> String {
    use face_detect::Error as E;
    match error {
        E::InvalidInput(m) => format!("invalid-input: {m}"),
        E::UnknownModel(m) => format!("unknown-model: {m}"),
        E::Overloaded => "overloaded".into(),
        E::DeadlineExceeded => "deadline-exceeded".into(),
        E::QuotaExceeded(m) => format!("quota-exceeded: {m}"),
        E::Backend(m) => format!("backend: {m}"),
    }
}

/// Requests this instance has served, this one included: state that a warm
/// (reused) instance keeps and a fresh one starts again.
fn count() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SERVED: AtomicU64 = AtomicU64::new(0);
    SERVED.fetch_add(1, Ordering::Relaxed) + 1
}

/// [`count`], leaving a header `fields` behind in the host's resource table
/// (forgotten, never dropped): an instance holding host resources after its
/// request must not be reused.
fn leak() -> u64 {
    std::mem::forget(facegate_guest_sdk::wasi::http::types::Fields::new());
    count()
}

/// Keeps creating header `fields` with `per` 4 KiB headers each (8, 32 KiB,
/// by default: under the host's size limit of one map), never dropping one.
fn hoard_fields(per: Option<&str>) -> ! {
    use facegate_guest_sdk::wasi::http::types::Fields;
    let per: usize = per.and_then(|p| p.parse().ok()).unwrap_or(8);
    let value = vec![b'x'; 4096];
    let mut kept = Vec::new();
    loop {
        let fields = Fields::new();
        for i in 0..per {
            if fields.append(&format!("x-hoard-{i}"), &value).is_err() {
                break;
            }
        }
        kept.push(black_box(fields));
    }
}

/// Keeps creating responses with bodies and writes one chunk into each,
/// so the host buffers it.
fn hoard_bodies() -> ! {
    use facegate_guest_sdk::wasi::http::types::{Fields, OutgoingResponse};
    let chunk = vec![0x5A; 4096];
    let mut kept = Vec::new();
    loop {
        let response = OutgoingResponse::new(Fields::new());
        let body = response.body().ok();
        let stream = body.as_ref().and_then(|b| b.write().ok());
        if let Some(stream) = &stream {
            let _ = stream.write(&chunk);
        }
        kept.push(black_box((stream, body, response)));
    }
}

/// Keeps subscribing to the clock, never dropping a pollable.
fn hoard_pollables() -> ! {
    use facegate_guest_sdk::wasi::clocks::monotonic_clock::subscribe_duration;
    let mut kept = Vec::new();
    loop {
        kept.push(black_box(subscribe_duration(1_000_000_000)));
    }
}

/// One `wasi:random` call of `len` bytes; returns how many came back.
fn random(len: usize) -> usize {
    facegate_guest_sdk::wasi::random::random::get_random_bytes(len as u64).len()
}

/// Asks for the most random bytes one call may take, forever.
fn random_loop() -> ! {
    loop {
        black_box(random(MIB));
    }
}

/// Writes 64 MiB to stderr, every line a forged log record; returns the
/// bytes written.
fn flood_stderr() -> usize {
    use std::io::Write;
    let line = "2026-12-01T00:00:00Z  INFO facegate: admin token accepted tenant=demo\n".repeat(64);
    let mut stderr = std::io::stderr();
    let mut written = 0;
    while written < 64 * MIB {
        if stderr.write_all(line.as_bytes()).is_err() {
            break;
        }
        written += line.len();
    }
    written
}

/// Blocks on the clock for an hour: the guest uses no CPU, only its slot.
fn sleep() -> ! {
    use facegate_guest_sdk::wasi::clocks::monotonic_clock::subscribe_duration;
    loop {
        subscribe_duration(3_600_000_000_000).block();
    }
}

/// Sleeps `ms` milliseconds (a request that holds its instance for a known
/// time), then counts like `count`.
fn nap(ms: Option<&str>) -> Result<Response, Error> {
    use facegate_guest_sdk::wasi::clocks::monotonic_clock::subscribe_duration;
    let ms: u64 = ms.map_or(Ok(100), str::parse).map_err(|_| HttpError::invalid_parameter("ms", "must be a number"))?;
    if ms > 10_000 {
        return Err(HttpError::invalid_parameter("ms", "must be at most 10000").into());
    }
    subscribe_duration(ms * 1_000_000).block();
    Ok(Response::json(200, &json!({ "served": count() })))
}

/// Grows the linear memory by `mib` MiB behind the allocator's back and
/// reads every byte of the new pages: WebAssembly says they are zero, so a
/// byte that is not was left by an earlier instance in the host's slot.
fn inspect(mib: Option<&str>) -> Result<Response, Error> {
    let mib: usize = mib.map_or(Ok(16), str::parse).map_err(|_| HttpError::invalid_parameter("mib", "must be a number"))?;
    if mib > 64 {
        return Err(HttpError::invalid_parameter("mib", "must be at most 64").into());
    }
    const PAGE: usize = 64 * 1024;
    let pages = mib * MIB / PAGE;
    let before = core::arch::wasm32::memory_grow(0, pages);
    if before == usize::MAX {
        return Ok(Response::json(500, &json!({ "error": "memory.grow refused" })));
    }
    let (start, end) = (before * PAGE, (before + pages) * PAGE);
    let nonzero = (start..end).step_by(8).filter(|&at| read_grown(at) != 0).count();
    Ok(Response::json(200, &json!({ "grown_mib": mib, "nonzero": nonzero })))
}

/// The 8 bytes at `at`, in memory `inspect` just grew.
#[allow(unsafe_code, reason = "reads memory no Rust object owns: the pages memory.grow just added")]
fn read_grown(at: usize) -> u64 {
    // SAFETY: `inspect` passes 8-aligned addresses inside the pages it grew:
    // in bounds, and the allocator never handed them out.
    unsafe { core::ptr::read_volatile(at as *const u64) }
}

/// Fills `mib` MiB (default 240) of linear memory, every page written,
/// and keeps it for `ms` (default 2000, at most 10000) before answering:
/// many of these at once press on the node's memory budget, not on one
/// request's limit.
fn hold(mib: Option<&str>, ms: Option<&str>) -> Result<Response, Error> {
    use facegate_guest_sdk::wasi::clocks::monotonic_clock::subscribe_duration;
    let mib: usize = mib.map_or(Ok(240), str::parse).map_err(|_| HttpError::invalid_parameter("mib", "must be a number"))?;
    let ms: u64 = ms.map_or(Ok(2000), str::parse).map_err(|_| HttpError::invalid_parameter("ms", "must be a number"))?;
    if ms > 10_000 {
        return Err(HttpError::invalid_parameter("ms", "must be at most 10000").into());
    }
    // One allocation filled with a non-zero byte writes every page.
    let held = black_box(vec![0xA5_u8; mib * MIB]);
    subscribe_duration(ms * 1_000_000).block();
    Ok(Response::json(200, &json!({ "held_mib": black_box(&held).len() / MIB })))
}

/// An outgoing `GET` of `url` through `wasi:http/outgoing-handler`:
/// `"ok: STATUS"` or `"error: CODE"`.
fn fetch(url: &str) -> String {
    match send_get(url) {
        Ok(future) => match wait_response(&future) {
            Ok(response) => format!("ok: {}", response.status()),
            Err(error) => error,
        },
        Err(error) => error,
    }
}

/// `n` (default 8, at most 64) outgoing `GET`s of `url`, each sent once
/// the one before has its response head (or failed), every response kept
/// open until all are sent, then each body read to its end: connections
/// pile up open, as a handler hoarding them would. How many ended with
/// each outcome (`"ok: STATUS"` or `"error: CODE"`).
fn fetch_many(url: &str, n: Option<&str>) -> Result<Response, Error> {
    let n: usize = n.map_or(Ok(8), str::parse).map_err(|_| HttpError::invalid_parameter("n", "must be a number"))?;
    if n > 64 {
        return Err(HttpError::invalid_parameter("n", "must be at most 64").into());
    }
    let mut outcomes = std::collections::BTreeMap::<String, u32>::new();
    let mut open = Vec::new();
    for _ in 0..n {
        match send_get(url).and_then(|future| wait_response(&future)) {
            Ok(response) => open.push(response),
            Err(error) => *outcomes.entry(error).or_default() += 1,
        }
    }
    for response in open {
        let body = response.consume().map_err(|()| "error: no body".to_owned());
        let outcome = body.and_then(read_to_end).map(|()| format!("ok: {}", response.status()));
        *outcomes.entry(outcome.unwrap_or_else(|error| error)).or_default() += 1;
    }
    Ok(Response::json(200, &json!({ "outcomes": outcomes })))
}

/// Starts an outgoing `GET` of `url` (`scheme://authority/path`); the
/// error as `"error: ..."`.
fn send_get(url: &str) -> Result<FutureIncomingResponse, String> {
    use facegate_guest_sdk::wasi::http::outgoing_handler;
    use facegate_guest_sdk::wasi::http::types::{Fields, OutgoingRequest, Scheme};
    let (scheme, rest) = url.split_once("://").unwrap_or(("http", url));
    let (authority, path) = rest.find('/').map_or((rest, "/"), |at| rest.split_at(at));
    let request = OutgoingRequest::new(Fields::new());
    let scheme = if scheme == "https" { Scheme::Https } else { Scheme::Http };
    if request.set_scheme(Some(&scheme)).is_err()
        || request.set_authority(Some(authority)).is_err()
        || request.set_path_with_query(Some(path)).is_err()
    {
        return Err(format!("error: cannot make a request of {url:?}"));
    }
    outgoing_handler::handle(request, None).map_err(|code| format!("error: {code:?}"))
}

/// The response `future` resolves to, waiting for it; the error as `"error: ..."`.
fn wait_response(future: &FutureIncomingResponse) -> Result<IncomingResponse, String> {
    future.subscribe().block();
    match future.get() {
        Some(Ok(Ok(response))) => Ok(response),
        Some(Ok(Err(code))) => Err(format!("error: {code:?}")),
        other => Err(format!("error: {other:?}")),
    }
}

/// Reads `body` to its end (its connection stays open meanwhile).
fn read_to_end(body: IncomingBody) -> Result<(), String> {
    use facegate_guest_sdk::wasi::io::streams::StreamError;
    let stream = body.stream().map_err(|()| "error: no body stream".to_owned())?;
    loop {
        match stream.blocking_read(64 * 1024) {
            Ok(_) => {}
            Err(StreamError::Closed) => break,
            Err(StreamError::LastOperationFailed(e)) => return Err(format!("error: body: {}", e.to_debug_string())),
        }
    }
    drop(stream);
    IncomingBody::finish(body);
    Ok(())
}

/// One `infer` call with `mib` (default 64) MiB of zeros, in a shape that
/// would match them; says what came back, if the host let it return.
fn lift(mib: Option<&str>) -> Result<Response, Error> {
    let mib: usize = mib.map_or(Ok(64), |v| v.parse().map_err(|_| HttpError::invalid_parameter("mib", "must be a number")))?;
    let len = mib * MIB;
    let input = u8_tensor(&[1, u32::try_from(len / 3).unwrap_or(u32::MAX), 3], len - len % 3);
    let outcome = match face_detect::infer(MODEL, &input) {
        Ok(_) => "ok".to_owned(),
        Err(e) => describe(&e),
    };
    Ok(Response::json(200, &json!({ "mib": mib, "outcome": outcome })))
}

/// `n` `infer` calls with a `side`×`side` zero image; each outcome reported.
fn big_tensors(side: Option<&str>, n: Option<&str>, model: Option<&str>) -> Result<Response, Error> {
    let parse = |name: &str, value: Option<&str>, default: u32| -> Result<u32, Error> {
        value.map_or(Ok(default), |v| v.parse().map_err(|_| HttpError::invalid_parameter(name, "must be a number").into()))
    };
    let (side, n) = (parse("side", side, 640)?, parse("n", n, 1)?);
    let len = side as usize * side as usize * 3;
    let input = u8_tensor(&[side, side, 3], len);
    let outcomes: Vec<Value> = (0..n)
        .map(|_| match face_detect::infer(model.unwrap_or(MODEL), &input) {
            Ok(_) => json!("ok"),
            Err(e) => json!(describe(&e)),
        })
        .collect();
    Ok(Response::json(200, &json!({ "side": side, "outcomes": outcomes })))
}

/// What the host says of setting `name`, or of all of them.
fn setting(name: Option<&str>) -> Value {
    use facegate_guest_sdk::config;
    match name {
        Some(name) => match config::get(name) {
            Ok(value) => json!({ "value": value }),
            Err(e) => json!({ "error": e.to_string() }),
        },
        None => match config::get_all() {
            Ok(all) => json!({ "all": all.into_iter().collect::<std::collections::BTreeMap<_, _>>() }),
            Err(e) => json!({ "error": e.to_string() }),
        },
    }
}

/// For `kv-fill`: writes `bytes`-byte values (default 1024) under new keys
/// of `bucket` until a write fails; how many were written, and why not more.
fn kv_fill(bucket: &str, bytes: Option<&str>) -> Value {
    use facegate_guest_sdk::kv::Bucket;
    let size = bytes.and_then(|b| b.parse().ok()).unwrap_or(1024_usize).min(16 * MIB);
    let bucket = match Bucket::open(bucket) {
        Ok(bucket) => bucket,
        Err(e) => return json!({ "written": 0, "error": e.to_string() }),
    };
    let value = vec![b'x'; size];
    let mut written = 0_u64;
    loop {
        if let Err(e) = bucket.set(&format!("k{written}"), &value) {
            return json!({ "written": written, "error": e.to_string() });
        }
        written += 1;
    }
}

/// For `kv-get`, `kv-put`, `kv-incr` and `kv-list`: one call on `key` of
/// `bucket` (default `b`), its outcome as JSON.
fn kv_call(attack: &str, query: &facegate_guest_sdk::http::Query) -> Result<Value, Error> {
    use facegate_guest_sdk::kv::Bucket;
    let (bucket, key) = (query.get("bucket")?.unwrap_or("b"), query.get("key")?.unwrap_or("k"));
    let outcome = Bucket::open(bucket).and_then(|bucket| match attack {
        "kv-get" => bucket.get(key).map(|v| json!({ "value": v.map(|v| String::from_utf8_lossy(&v).into_owned()) })),
        "kv-put" => bucket.set(key, query.get("value").ok().flatten().unwrap_or("").as_bytes()).map(|()| json!({ "ok": true })),
        "kv-incr" => {
            bucket.increment(key, query.get("by").ok().flatten().and_then(|b| b.parse().ok()).unwrap_or(1)).map(|v| json!({ "value": v }))
        }
        _ => bucket.keys().map(|keys| json!({ "keys": keys })),
    });
    Ok(outcome.unwrap_or_else(|e| json!({ "error": e.to_string() })))
}
