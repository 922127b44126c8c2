//! `--inference-cores` through the binary: inference on a core of its own,
//! every other thread of the gateway on the others.

use std::collections::BTreeMap;

use facegate_host_gpu::affinity::allowed_cores;
use reqwest::Method;
use serde_json::json;

use crate::harness::{fresh_dir, guest};
use crate::process::Server;

/// Each thread of process `pid`, by name: the cores it may run on.
fn thread_cores(pid: u32) -> BTreeMap<String, Vec<Vec<usize>>> {
    let mut threads: BTreeMap<String, Vec<Vec<usize>>> = BTreeMap::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let path = task.unwrap().path();
        let (Ok(name), Ok(status)) = (std::fs::read_to_string(path.join("comm")), std::fs::read_to_string(path.join("status"))) else {
            continue; // a thread that ended meanwhile
        };
        let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap().trim();
        threads.entry(name.trim().to_owned()).or_default().push(cores_of(list));
    }
    threads
}

/// `0-2,5` → [0, 1, 2, 5].
fn cores_of(list: &str) -> Vec<usize> {
    list.split(',')
        .flat_map(|part| match part.split_once('-') {
            Some((a, b)) => (a.parse().unwrap()..=b.parse().unwrap()).collect::<Vec<usize>>(),
            None => vec![part.parse().unwrap()],
        })
        .collect()
}

/// With one core reserved, the device worker runs only on the last core,
/// the handlers' and HTTP's threads (tokio's workers) and the rest only on
/// the others, and a request is answered as usual.
#[test]
fn a_reserved_core_runs_inference_and_the_others_everything_else() {
    let allowed = allowed_cores().unwrap();
    if allowed.len() < 2 {
        // Nothing to split (the refusal is the next test's). Said on the
        // test run's own stderr, past libtest's capture, so that a pass on
        // such a machine is not taken for a check.
        let note = format!(
            "cores: SKIPPED a_reserved_core_runs_inference_and_the_others_everything_else: this process may run on {allowed:?} only, it needs 2 cores\n"
        );
        std::io::Write::write_all(&mut std::io::stderr(), note.as_bytes()).unwrap();
        // What still holds on one core: the split the gateway would make
        // refuses it, and splits two cores as this test expects.
        let refused = facegate::serve::cores::split(&allowed, 1).unwrap_err().to_string();
        assert!(refused.contains("no core for the handlers"), "{refused}");
        let two = [allowed[0], allowed[0] + 1];
        let split = facegate::serve::cores::split(&two, 1).unwrap();
        assert_eq!((split.inference, split.handlers), (vec![two[1]], vec![two[0]]));
        return;
    }
    let (inference, handlers) = (vec![*allowed.last().unwrap()], allowed[..allowed.len() - 1].to_vec());
    let data = fresh_dir("inference-cores");
    let server = Server::start_with(&data, &["--inference-cores", "1"]);
    server.json(server.admin(Method::POST, "tenants").json(&json!({ "name": "t" })));
    let key = server.json(server.admin(Method::POST, "tenants/t/keys"))["key"].as_str().unwrap().to_owned();
    server.json(server.admin(Method::PUT, "tenants/t/handlers/h").body(std::fs::read(guest("detect")).unwrap()));
    assert_eq!(server.call(&key).0, 200);

    let threads = thread_cores(server.pid());
    assert_eq!(threads.get("centerface-dev0"), Some(&vec![inference.clone()]), "{threads:?}");
    let workers = threads.get("tokio-rt-worker").unwrap_or_else(|| panic!("no tokio worker in {threads:?}"));
    for (name, sets) in &threads {
        let expected = if name.starts_with("centerface-dev") || name == "ort-intra-op" { &inference } else { &handlers };
        assert!(sets.iter().all(|cores| cores == expected), "{name} may run on {sets:?}, not only {expected:?}");
    }
    assert!(!workers.is_empty());
}

/// Reserving every core would leave the handlers none: refused at start,
/// with a message that says so.
#[test]
fn reserving_every_core_is_refused_at_start() {
    let cores = allowed_cores().unwrap().len().to_string();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_facegate"))
        .args(["serve", "--inference-cores", &cores, "--listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(fresh_dir("inference-cores-all"))
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("leaves no core for the handlers"), "{stderr}");
}
