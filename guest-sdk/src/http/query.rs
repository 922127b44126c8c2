//! Query strings: percent-decoding and typed, validated parameters.

use std::str::FromStr;

use super::HttpError;

/// The decoded `name=value` pairs of a query string, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Query {
    pairs: Vec<(String, String)>,
}

impl Query {
    /// Parses `a=1&b=x%20y` (no leading `?`). `+` is a space, `%XX` a byte;
    /// malformed escapes are kept as they are; a name without `=` has an
    /// empty value.
    pub fn parse(query: &str) -> Self {
        let pairs = query
            .split('&')
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
                (percent_decode(name), percent_decode(value))
            })
            .collect();
        Self { pairs }
    }

    /// All pairs, in order.
    pub fn pairs(&self) -> &[(String, String)] {
        &self.pairs
    }

    /// The value of `name`; an error if it is given more than once.
    pub fn get(&self, name: &str) -> Result<Option<&str>, HttpError> {
        let mut values = self.pairs.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_str());
        let first = values.next();
        if values.next().is_some() {
            return Err(HttpError::invalid_parameter(name, "is given more than once"));
        }
        Ok(first)
    }

    /// The value of `name` parsed as `T` and checked by `valid`, or
    /// `default` when absent. `expected` says in words what is valid, for
    /// the error message (e.g. `"a number with 0 < threshold ≤ 1"`).
    pub fn parse_or<T: FromStr + Copy>(&self, name: &str, default: T, expected: &str, valid: impl Fn(T) -> bool) -> Result<T, HttpError> {
        let Some(raw) = self.get(name)? else {
            return Ok(default);
        };
        match raw.trim().parse::<T>() {
            Ok(value) if valid(value) => Ok(value),
            _ => Err(HttpError::invalid_parameter(name, &format!("must be {expected}, got {raw:?}"))),
        }
    }
}

/// Decodes `%XX` escapes and `+`; invalid UTF-8 becomes U+FFFD.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() && hex_pair(bytes[i + 1], bytes[i + 2]).is_some() => {
                out.extend(hex_pair(bytes[i + 1], bytes[i + 2]));
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex_pair(high: u8, low: u8) -> Option<u8> {
    let digit = |c: u8| (c as char).to_digit(16);
    Some((digit(high)? * 16 + digit(low)?) as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_decodes_pairs() {
        let q = Query::parse("threshold=0.7&name=a+b%20c&flag&&x=%zz%4");
        assert_eq!(q.get("threshold").expect("once"), Some("0.7"));
        assert_eq!(q.get("name").expect("once"), Some("a b c"));
        assert_eq!(q.get("flag").expect("once"), Some(""));
        assert_eq!(q.get("x").expect("once"), Some("%zz%4"));
        assert_eq!(q.get("missing").expect("absent"), None);
        assert_eq!(Query::parse("").pairs().len(), 0);
    }

    #[test]
    fn typed_values_are_validated_and_name_the_parameter() {
        let q = Query::parse("threshold=1.5&max_faces=10&bad=abc");
        let in_range = |t: f32| t > 0.0 && t <= 1.0;
        let error = q.parse_or("threshold", 0.5, "in (0, 1]", in_range).expect_err("must fail");
        assert_eq!((error.status(), error.code()), (400, "invalid_parameter"));
        assert!(error.to_string().contains("threshold"), "{error}");
        assert_eq!(q.parse_or("max_faces", 100u32, "1..=1000", |n| (1..=1000).contains(&n)), Ok(10));
        assert_eq!(q.parse_or("absent", 0.5f32, "any", |_| true), Ok(0.5));
        assert!(q.parse_or("bad", 1u32, "a number", |_| true).is_err());
    }

    #[test]
    fn repeated_and_non_finite_values_are_rejected() {
        let q = Query::parse("t=0.5&t=0.6&n=NaN");
        assert!(q.get("t").is_err());
        assert!(q.parse_or("n", 0.5f32, "finite", f32::is_finite).is_err());
    }
}
