//! What an upload's compile holds at its peak, measured, against what the
//! node's memory budget charges for it before it starts
//! (`facegate::sandbox::compile::upload_memory_estimate`).
//!
//! Each upload is prepared as the gateway prepares it (the pipeline linked
//! in when it imports it, compiled on a compile pool of the default size,
//! serialised to its artifact) in a child process of its own: the child's
//! peak resident memory (`VmHWM`, reset just before through
//! `/proc/self/clear_refs`) over its resident memory before is the measured
//! peak, whatever holds it (heap, the compiler's threads, mapped code).
//! The estimate must cover it, and not by more than a bound, or the budget
//! would refuse uploads it could hold.
//!
//! Its own test binary (`harness = false`): it runs children of itself.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test")]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use facegate::sandbox::compile::{CompilePool, upload_memory_estimate};
use facegate::sandbox::engine::{EngineLimits, build};

/// Set in a child: the component it prepares (and the pipeline, after a `;`).
const CHILD: &str = "FACEGATE_COMPILE_MEMORY_CHILD";
/// How far above the measured peak the estimate may be.
const MOST_OVER: f64 = 4.0;

fn main() {
    if let Ok(spec) = std::env::var(CHILD) {
        return child(&spec);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let guests = root.join("guests/target/wasm32-wasip2/release");
    let pipeline = guests.join("pipeline.wasm");
    let mut cases = vec![(guests.join("detect.wasm"), None), (guests.join("hostile.wasm"), None), (pipeline.clone(), None)];
    cases.push((script_detect(&root, "python"), Some(pipeline.clone())));
    cases.push((script_detect(&root, "js"), Some(pipeline)));
    let mut failed = 0;
    for (component, pipeline) in &cases {
        failed += usize::from(!check(component, pipeline.as_deref()));
    }
    println!("{} passed, {failed} failed", cases.len() - failed);
    assert_eq!(failed, 0, "an estimate does not fit what a compile holds");
}

/// Measures one upload in a child; whether the estimate covers it within [`MOST_OVER`].
fn check(component: &Path, pipeline: Option<&Path>) -> bool {
    assert!(component.exists(), "{} missing: run deploy/scripts/build-guests.sh", component.display());
    let spec = match pipeline {
        Some(p) => format!("{};{}", component.display(), p.display()),
        None => component.display().to_string(),
    };
    let output = Command::new(std::env::current_exe().unwrap()).env(CHILD, spec).output().unwrap();
    assert!(output.status.success(), "child failed: {}", String::from_utf8_lossy(&output.stderr));
    let peak: usize = String::from_utf8_lossy(&output.stdout).trim().parse().unwrap();
    let size = std::fs::metadata(component).unwrap().len() as usize;
    let estimate = upload_memory_estimate(size, pipeline.map(|p| std::fs::metadata(p).unwrap().len() as usize));
    let name = component.file_name().unwrap().to_string_lossy();
    let ok = estimate >= peak && (estimate as f64) <= MOST_OVER * peak as f64;
    println!(
        "{} {name} ({} KiB{}): peak {} MiB, estimate {} MiB ({:.1}x)",
        if ok { "ok  " } else { "FAIL" },
        size >> 10,
        if pipeline.is_some() { " + pipeline" } else { "" },
        peak >> 20,
        estimate >> 20,
        estimate as f64 / peak.max(1) as f64
    );
    ok
}

/// The child: prepares one upload as the gateway does and prints its peak (bytes).
fn child(spec: &str) {
    let (component, pipeline) = spec.split_once(';').map_or((spec, None), |(c, p)| (c, Some(p)));
    let engine = build(EngineLimits { max_instances: 4, memory_limit: 64 << 20, keep_resident: 0 }).unwrap();
    let pool = CompilePool::new(facegate::config::DEFAULT_COMPILE_THREADS, 0, Duration::from_secs(600)).unwrap();
    let bytes = std::fs::read(component).unwrap();
    let pipeline = pipeline.map(|p| std::fs::read(p).unwrap());
    // Warm the pool's thread, then measure from here.
    pool.run(|| ()).unwrap();
    let before = status_kib("VmRSS");
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let artifact = pool
        .run(move || {
            let linked = match &pipeline {
                Some(p) => facegate::control::compose::plug_pipeline(&bytes, p).unwrap(),
                None => bytes,
            };
            let compiled = wasmtime::component::Component::new(&engine, &linked).unwrap();
            compiled.serialize().unwrap()
        })
        .unwrap();
    let peak = status_kib("VmHWM").saturating_sub(before) * 1024;
    drop(artifact);
    println!("{peak}");
}

/// A field of /proc/self/status, KiB.
fn status_kib(field: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The `detect` example in `language` (`python`, `js`), built with the project's build command.
fn script_detect(root: &Path, language: &str) -> PathBuf {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("compile-memory-{}/detect-{language}.wasm", std::process::id()));
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let script = root.join(format!("deploy/scripts/build-{language}.sh"));
    let status = Command::new(script).arg(root.join("guests").join(language).join("detect")).arg(&out).status().unwrap();
    assert!(status.success(), "building the {language} example failed");
    out
}
