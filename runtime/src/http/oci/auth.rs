//! Registry credentials, found as the ecosystem's tools find them (flags,
//! then the Docker config file and its credential helpers), and the
//! registry's authentication challenges (`Basic`, or `Bearer` with a token
//! service, as Docker Hub, GHCR and the distribution registry use).

use std::path::PathBuf;

use anyhow::Context;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

/// A user name and password (or token) for one registry. Its `Debug`
/// never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The user name.
    pub username: String,
    /// The password or access token.
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials").field("username", &self.username).field("password", &"<redacted>").finish()
    }
}

impl Credentials {
    /// The `Authorization` value for HTTP Basic.
    pub fn basic(&self) -> String {
        format!("Basic {}", STANDARD.encode(format!("{}:{}", self.username, self.password)))
    }
}

/// The Docker config file: `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`.
pub fn docker_config_path() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("DOCKER_CONFIG") {
        return Some(PathBuf::from(dir).join("config.json"));
    }
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".docker/config.json"))
}

/// `registry`'s credentials in the Docker config file, if it has any:
/// `auths` (`auth`, or `username` and `password`), else the credential
/// helper `credHelpers` or `credsStore` names (`docker-credential-NAME get`).
/// `registry` is looked up as given (`host:port`), then as its host alone.
pub fn from_docker_config(registry: &str) -> anyhow::Result<Option<Credentials>> {
    let Some(path) = docker_config_path() else { return Ok(None) };
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let config: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let host = super::reference::host_of(registry);
    let mut keys = vec![registry.to_owned(), host.to_owned(), format!("https://{registry}"), format!("http://{registry}")];
    if registry == "docker.io" {
        // Where `docker login` keeps Docker Hub's.
        keys.push("https://index.docker.io/v1/".to_owned());
    }
    for key in &keys {
        if let Some(helper) = config["credHelpers"][key].as_str() {
            return helper_get(helper, registry);
        }
        if let Some(entry) = config["auths"].get(key.as_str())
            && let Some(credentials) = from_auth_entry(entry)?
        {
            return Ok(Some(credentials));
        }
    }
    match config["credsStore"].as_str() {
        Some(store) => helper_get(store, registry),
        None => Ok(None),
    }
}

/// An `auths` entry's credentials: `auth` (base64 of `user:password`), or
/// `username` and `password`; `None` for an entry with neither.
fn from_auth_entry(entry: &serde_json::Value) -> anyhow::Result<Option<Credentials>> {
    if let Some(auth) = entry["auth"].as_str().filter(|a| !a.is_empty()) {
        let decoded = STANDARD.decode(auth).context("an `auth` in the Docker config is not base64")?;
        let text = String::from_utf8(decoded).context("an `auth` in the Docker config is not text")?;
        let (username, password) = text.split_once(':').context("an `auth` in the Docker config is not user:password")?;
        return Ok(Some(Credentials { username: username.to_owned(), password: password.to_owned() }));
    }
    match (entry["username"].as_str(), entry["password"].as_str()) {
        (Some(username), Some(password)) => Ok(Some(Credentials { username: username.to_owned(), password: password.to_owned() })),
        _ => Ok(None),
    }
}

/// Runs `docker-credential-{helper} get` for `registry`, as Docker does.
fn helper_get(helper: &str, registry: &str) -> anyhow::Result<Option<Credentials>> {
    use std::io::Write as _;
    let program = format!("docker-credential-{helper}");
    let mut child = std::process::Command::new(&program)
        .arg("get")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .with_context(|| format!("cannot run the Docker credential helper {program}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(registry.as_bytes())?;
    }
    let output = child.wait_with_output()?;
    if !output.status.success() {
        // The helper's way of saying it has none for this registry.
        return Ok(None);
    }
    let value: serde_json::Value = serde_json::from_slice(&output.stdout).with_context(|| format!("{program} answered no JSON"))?;
    match (value["Username"].as_str(), value["Secret"].as_str()) {
        (Some(username), Some(secret)) => Ok(Some(Credentials { username: username.to_owned(), password: secret.to_owned() })),
        _ => Ok(None),
    }
}

/// How a registry asks a client to authenticate (`WWW-Authenticate`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Challenge {
    /// Send the credentials with each request.
    Basic,
    /// Get a token from `realm` (with the credentials, if any) and send it.
    Bearer {
        /// The token service's URL.
        realm: String,
        /// Its `service` parameter, if given.
        service: Option<String>,
        /// Its `scope` parameter, if given.
        scope: Option<String>,
    },
}

/// Parses a `WWW-Authenticate` value: `Basic realm="…"` or
/// `Bearer realm="…",service="…",scope="…"` (quoted values may hold commas).
pub fn parse_challenge(header: &str) -> Option<Challenge> {
    let (scheme, params) = header.trim().split_once(' ').unwrap_or((header.trim(), ""));
    if scheme.eq_ignore_ascii_case("basic") {
        return Some(Challenge::Basic);
    }
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let params = parse_params(params);
    let get = |name: &str| params.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone());
    Some(Challenge::Bearer { realm: get("realm")?, service: get("service"), scope: get("scope") })
}

/// `k="v",k2=v2` pairs; a quoted value runs to its closing quote (`\"` escapes).
fn parse_params(text: &str) -> Vec<(String, String)> {
    let mut params = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let name: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if name.is_empty() {
            return params;
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next()),
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            value = chars.by_ref().take_while(|c| *c != ',').collect::<String>().trim().to_owned();
        }
        params.push((name.trim().to_owned(), value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_parse_as_registries_send_them() {
        assert_eq!(parse_challenge("Basic realm=\"Registry Realm\""), Some(Challenge::Basic));
        let ghcr = r#"Bearer realm="https://ghcr.io/token",service="ghcr.io",scope="repository:acme/faces:pull,push""#;
        assert_eq!(
            parse_challenge(ghcr),
            Some(Challenge::Bearer {
                realm: "https://ghcr.io/token".into(),
                service: Some("ghcr.io".into()),
                scope: Some("repository:acme/faces:pull,push".into())
            })
        );
        assert_eq!(
            parse_challenge("bearer realm=https://auth.example/token"),
            Some(Challenge::Bearer { realm: "https://auth.example/token".into(), service: None, scope: None })
        );
        assert_eq!(parse_challenge("Bearer service=\"x\""), None, "no realm, no token service");
        assert_eq!(parse_challenge("Negotiate"), None);
    }

    #[test]
    fn docker_config_entries_give_credentials_and_never_show_the_password() {
        let entry = serde_json::json!({ "auth": STANDARD.encode("ci:s3cr:et") });
        let credentials = from_auth_entry(&entry).unwrap().unwrap();
        assert_eq!((credentials.username.as_str(), credentials.password.as_str()), ("ci", "s3cr:et"));
        assert!(!format!("{credentials:?}").contains("s3cr"));
        assert_eq!(credentials.basic(), format!("Basic {}", STANDARD.encode("ci:s3cr:et")));
        let entry = serde_json::json!({ "username": "u", "password": "p" });
        assert_eq!(from_auth_entry(&entry).unwrap().unwrap().username, "u");
        assert_eq!(from_auth_entry(&serde_json::json!({})).unwrap(), None);
        assert!(from_auth_entry(&serde_json::json!({ "auth": "!!" })).is_err());
    }
}
