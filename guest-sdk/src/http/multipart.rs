//! A small, strict `multipart/form-data` parser (RFC 7578 over RFC 2046)
//! for bodies already in memory.
//!
//! Parts are borrowed slices of the body: nothing is copied. Lines end in
//! CRLF as the RFC requires (browsers and curl send CRLF). The boundary
//! must be 1–70 characters from the RFC's set, which also keeps the search
//! for delimiters linear in the body's size.

use super::{HttpError, parse_params};

/// Most bytes of headers one part may have.
const MAX_PART_HEADER_BYTES: usize = 8 * 1024;
/// Most parts a body may have.
const MAX_PARTS: usize = 64;

/// One part of a `multipart/form-data` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part<'a> {
    /// `name` from `Content-Disposition: form-data; name="…"`.
    pub name: Option<String>,
    /// `filename` from `Content-Disposition`, if any.
    pub filename: Option<String>,
    /// The part's `Content-Type`, if any.
    pub content_type: Option<String>,
    /// The part's content.
    pub body: &'a [u8],
}

/// Splits a `multipart/form-data` body into its parts.
pub fn parse<'a>(body: &'a [u8], boundary: &str) -> Result<Vec<Part<'a>>, HttpError> {
    check_boundary(boundary)?;
    let delimiter = format!("\r\n--{boundary}");
    let delimiter = delimiter.as_bytes();
    // The first delimiter may start the body (no CRLF before it) or follow a preamble.
    let mut rest = match body.strip_prefix(&delimiter[2..]) {
        Some(rest) => rest,
        None => after(body, delimiter).ok_or_else(|| invalid("no boundary line in the body"))?,
    };
    let mut parts = Vec::new();
    loop {
        if rest.starts_with(b"--") {
            return Ok(parts); // the close delimiter; the epilogue is ignored
        }
        rest = skip_to_line_end(rest)?;
        if parts.len() == MAX_PARTS {
            return Err(invalid(&format!("more than {MAX_PARTS} parts")));
        }
        let (part, next) = parse_part(rest, delimiter)?;
        parts.push(part);
        rest = next;
    }
}

/// The content of the first part named `name`.
pub fn field<'a>(body: &'a [u8], boundary: &str, name: &str) -> Result<&'a [u8], HttpError> {
    parse(body, boundary)?
        .into_iter()
        .find(|part| part.name.as_deref() == Some(name))
        .map(|part| part.body)
        .ok_or_else(|| HttpError::MissingField(name.to_string()))
}

/// Parses one part starting after its delimiter line; returns it and what
/// follows its closing delimiter.
fn parse_part<'a>(rest: &'a [u8], delimiter: &[u8]) -> Result<(Part<'a>, &'a [u8]), HttpError> {
    let (headers, content) = split_headers(rest)?;
    let end = find(content, delimiter).ok_or_else(|| invalid("a part does not end with the boundary"))?;
    let mut part = Part { name: None, filename: None, content_type: None, body: &content[..end] };
    read_headers(headers, &mut part)?;
    Ok((part, &content[end + delimiter.len()..]))
}

/// Splits a part into its header lines and its content at the blank line.
fn split_headers(rest: &[u8]) -> Result<(&[u8], &[u8]), HttpError> {
    if let Some(content) = rest.strip_prefix(b"\r\n") {
        return Ok((&[], content)); // no headers at all
    }
    let window = &rest[..rest.len().min(MAX_PART_HEADER_BYTES + 4)];
    let end = find(window, b"\r\n\r\n").ok_or_else(|| {
        let why = if window.len() < rest.len() { "are too long" } else { "do not end" };
        invalid(&format!("a part's headers {why}"))
    })?;
    Ok((&rest[..end], &rest[end + 4..]))
}

/// Fills `name`, `filename` and `content_type` from a part's header lines.
fn read_headers(headers: &[u8], part: &mut Part<'_>) -> Result<(), HttpError> {
    let text = std::str::from_utf8(headers).map_err(|_| invalid("a part's headers are not UTF-8"))?;
    for line in text.split("\r\n").filter(|l| !l.is_empty()) {
        let (name, value) = line.split_once(':').ok_or_else(|| invalid("a part's header has no colon"))?;
        if name.trim().eq_ignore_ascii_case("content-disposition") {
            let (kind, params) = value.split_once(';').unwrap_or((value, ""));
            if !kind.trim().eq_ignore_ascii_case("form-data") {
                return Err(invalid("a part is not form-data"));
            }
            for (key, value) in parse_params(params) {
                match key.as_str() {
                    "name" => part.name = Some(value),
                    "filename" => part.filename = Some(value),
                    _ => {}
                }
            }
        } else if name.trim().eq_ignore_ascii_case("content-type") {
            part.content_type = Some(value.trim().to_string());
        }
    }
    Ok(())
}

/// After a delimiter: optional transport padding (spaces, tabs), then CRLF.
fn skip_to_line_end(rest: &[u8]) -> Result<&[u8], HttpError> {
    let padding = rest.iter().take_while(|&&b| b == b' ' || b == b'\t').count();
    rest[padding..].strip_prefix(b"\r\n").ok_or_else(|| invalid("a boundary line does not end in CRLF"))
}

fn check_boundary(boundary: &str) -> Result<(), HttpError> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "'()+_,-./:=? ".contains(c);
    if boundary.is_empty() || boundary.len() > 70 || !boundary.chars().all(allowed) || boundary.ends_with(' ') {
        return Err(invalid("the boundary is not 1-70 allowed characters"));
    }
    Ok(())
}

/// Position of the first occurrence of `needle`. Candidates start at its
/// first byte (`\r` for a delimiter); a boundary has no `\r`, so no
/// candidate starts inside a partial match and the search stays linear.
fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    let mut start = 0;
    while start + needle.len() <= haystack.len() {
        let i = start + haystack[start..].iter().position(|&b| b == needle[0])?;
        if haystack.get(i..i + needle.len()) == Some(needle) {
            return Some(i);
        }
        start = i + 1;
    }
    None
}

/// The bytes after the first occurrence of `needle`.
fn after<'a>(haystack: &'a [u8], needle: &[u8]) -> Option<&'a [u8]> {
    find(haystack, needle).map(|i| &haystack[i + needle.len()..])
}

fn invalid(message: &str) -> HttpError {
    HttpError::InvalidMultipart(message.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: &str = "----facegate42";

    fn form(parts: &[(&str, Option<&str>, &[u8])]) -> Vec<u8> {
        let mut body = b"preamble to ignore\r\n".to_vec();
        for (name, filename, content) in parts {
            body.extend_from_slice(format!("--{B}\r\n").as_bytes());
            let file = filename.map(|f| format!("; filename=\"{f}\"")).unwrap_or_default();
            body.extend_from_slice(format!("Content-Disposition: form-data; name=\"{name}\"{file}\r\n").as_bytes());
            if filename.is_some() {
                body.extend_from_slice(b"Content-Type: image/jpeg\r\n");
            }
            body.extend_from_slice(b"\r\n");
            body.extend_from_slice(content);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(format!("--{B}--\r\nepilogue").as_bytes());
        body
    }

    #[test]
    fn finds_the_image_field_among_others() {
        let image: &[u8] = b"\xff\xd8binary\r\n--not-the-boundary\r\n\xff\xd9";
        let body = form(&[("threshold", None, b"0.7"), ("image", Some("me.jpg"), image)]);
        let parts = parse(&body, B).expect("parses");
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].name.as_deref(), Some("threshold"));
        assert_eq!(parts[0].body, b"0.7");
        assert_eq!(parts[1].filename.as_deref(), Some("me.jpg"));
        assert_eq!(parts[1].content_type.as_deref(), Some("image/jpeg"));
        assert_eq!(field(&body, B, "image").expect("field"), image);
    }

    #[test]
    fn body_may_start_with_the_delimiter_and_parts_may_be_empty() {
        let body = format!("--{B}\r\nContent-Disposition: form-data; name=image\r\n\r\n\r\n--{B}--");
        assert_eq!(field(body.as_bytes(), B, "image").expect("field"), b"");
    }

    #[test]
    fn a_missing_field_is_named() {
        let body = form(&[("other", None, b"x")]);
        let error = field(&body, B, "image").expect_err("must fail");
        assert_eq!((error.status(), error.code()), (400, "missing_field"));
        assert!(error.to_string().contains("image"));
    }

    #[test]
    fn malformed_bodies_are_rejected() {
        let unterminated = format!("--{B}\r\nContent-Disposition: form-data; name=\"image\"\r\n\r\nabc");
        let no_headers_end = format!("--{B}\r\nContent-Disposition: form-data; name=\"image\"");
        let not_form_data = format!("--{B}\r\nContent-Disposition: attachment\r\n\r\nx\r\n--{B}--");
        for body in ["no boundary here".to_string(), unterminated, no_headers_end, not_form_data] {
            let error = parse(body.as_bytes(), B).expect_err("must fail");
            assert_eq!(error.code(), "invalid_multipart", "{body:?}");
        }
        assert!(parse(b"", "").is_err());
        assert!(parse(b"", &"x".repeat(71)).is_err());
        assert!(parse(b"", "bad\rboundary").is_err());
    }

    #[test]
    fn find_is_exact() {
        assert_eq!(find(b"ab\r\n--x\r\n--xyz", b"\r\n--xyz"), Some(7));
        assert_eq!(find(b"\r\n--x", b"\r\n--xyz"), None);
    }
}
