//! Finding a model's final number in free text, and comparing numbers.
//!
//! Models state answers in many ways: `\boxed{1,234}`, `#### 72`,
//! `The answer is $72.00.`, or just a last number in a sentence. The
//! extractor prefers the most explicit statement and falls back to the last
//! number. Numbers come back in a canonical decimal form (no thousands
//! separators, no leading zeros, no trailing fractional zeros, no `-0`), so
//! two answers are equal exactly when their canonical strings are: exact at
//! any length, with none of the rounding of `f64`.
//!
//! The scan works on bytes: every marker and digit is ASCII, and non-ASCII
//! bytes (always >= 0x80 in UTF-8) never match one, so unicode text is
//! simply skipped and no slice can split a character.

/// The model's final number, in canonical form: the explicit statement if
/// there is one ([`explicit_final_number`]), else the last number in the
/// text. `None` when the text has no number at all.
pub fn extract_final_number(text: &str) -> Option<String> {
    explicit_final_number(text).or_else(|| Numbers::new(text.as_bytes(), 0).last())
}

/// The number a text explicitly states as its answer, in order of
/// preference: the last `\boxed{...}` (its last number), the first number
/// after the last `####`, the first number after the last "answer is" or
/// "answer:" (any case). `None` when no marker is followed by a number.
pub fn explicit_final_number(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    boxed(bytes)
        .or_else(|| after_marker(bytes, &[b"####"]))
        .or_else(|| after_marker(&bytes.to_ascii_lowercase(), &[b"answer is", b"answer:"]))
}

/// The canonical form of a text that is one number and nothing else, with
/// the decorations answers carry tolerated: surrounding whitespace, a
/// leading `+`, `$` or `-$`, thousands separators, a trailing `%` or period.
pub fn canonical_number(text: &str) -> Option<String> {
    let t = text.trim();
    let t = t.strip_suffix('.').unwrap_or(t);
    let t = t.strip_suffix('%').unwrap_or(t).trim_end();
    let t = t.strip_prefix('+').unwrap_or(t);
    let bytes = t.as_bytes();
    let mut numbers = Numbers::new(bytes, 0);
    let first = numbers.next()?;
    // The number's span (sign and `$` included) must be the whole text.
    (numbers.span == (0, bytes.len())).then_some(first)
}

/// Whether two texts are the same number ([`canonical_number`] of both).
pub fn numbers_equal(a: &str, b: &str) -> bool {
    match (canonical_number(a), canonical_number(b)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// The last number inside the last `\boxed{...}`, braces balanced (an
/// unclosed box runs to the end of the text).
fn boxed(bytes: &[u8]) -> Option<String> {
    const OPEN: &[u8] = b"\\boxed{";
    let start = rfind(bytes, OPEN)? + OPEN.len();
    let mut depth = 1usize;
    let mut end = bytes.len();
    for (i, &b) in bytes.iter().enumerate().skip(start) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    end = i;
                    break;
                }
            }
            _ => {}
        }
    }
    Numbers::new(&bytes[..end], start).last()
}

/// The first number after the last occurrence of any of the markers.
fn after_marker(bytes: &[u8], markers: &[&[u8]]) -> Option<String> {
    let at = markers
        .iter()
        .filter_map(|m| rfind(bytes, m).map(|i| i + m.len()))
        .max()?;
    Numbers::new(bytes, at).next()
}

fn rfind(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || haystack.len() < needle.len() {
        return None;
    }
    haystack.windows(needle.len()).rposition(|w| w == needle)
}

/// The numbers of a byte string from a position on, canonical. `span` is
/// the byte range of the last one returned, sign and `$` included.
struct Numbers<'a> {
    bytes: &'a [u8],
    pos: usize,
    span: (usize, usize),
}

impl<'a> Numbers<'a> {
    fn new(bytes: &'a [u8], from: usize) -> Self {
        Self {
            bytes,
            pos: from.min(bytes.len()),
            span: (0, 0),
        }
    }

    fn digits_from(&self, i: usize) -> usize {
        self.bytes[i..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count()
    }

    /// Whether a minus sign ending just before `at` is a sign rather than a
    /// subtraction: it must not follow a word, a number or a closing bracket
    /// (`16-3` is a subtraction, `= -3` and `(-3)` are negative).
    fn sign_before(&self, at: usize) -> Option<usize> {
        let b = self.bytes;
        // ASCII hyphen, or U+2212 MINUS SIGN (E2 88 92).
        let start = if at >= 1 && b[at - 1] == b'-' {
            at - 1
        } else if at >= 3 && &b[at - 3..at] == "\u{2212}".as_bytes() {
            at - 3
        } else {
            return None;
        };
        let after_operand = start > 0 && {
            let p = b[start - 1];
            p.is_ascii_alphanumeric() || matches!(p, b')' | b']' | b'}' | b'.' | b'_')
        };
        (!after_operand).then_some(start)
    }
}

impl Iterator for Numbers<'_> {
    type Item = String;

    fn next(&mut self) -> Option<String> {
        let b = self.bytes;
        let start = self.pos + b.get(self.pos..)?.iter().position(u8::is_ascii_digit)?;

        // Sign, possibly before a dollar sign ("-$5").
        let dollar = start > 0 && b[start - 1] == b'$';
        let sign_end = if dollar { start - 1 } else { start };
        let sign = self.sign_before(sign_end);
        let span_start = sign.unwrap_or(if dollar { start - 1 } else { start });

        // Integer part, with thousands separators only after a group of at
        // most three digits and only before exactly three ("1,234,567";
        // "1,23" and "2,3,4" are separate numbers).
        let first = self.digits_from(start);
        let mut int = b[start..start + first].to_vec();
        let mut i = start + first;
        if first <= 3 {
            while i + 4 <= b.len() && b[i] == b',' && self.digits_from(i + 1) == 3 {
                int.extend_from_slice(&b[i + 1..i + 4]);
                i += 4;
            }
        }

        // Fraction: a period followed by a digit ("72." ends a sentence).
        let mut frac = Vec::new();
        if i + 1 < b.len() && b[i] == b'.' && b[i + 1].is_ascii_digit() {
            let n = self.digits_from(i + 1);
            frac.extend_from_slice(&b[i + 1..i + 1 + n]);
            i += 1 + n;
        }

        self.pos = i;
        self.span = (span_start, i);
        Some(canonical(sign.is_some(), &int, &frac))
    }
}

/// `[-]int[.frac]` without leading or trailing zeros, and zero unsigned.
fn canonical(negative: bool, int: &[u8], frac: &[u8]) -> String {
    let int = match int.iter().position(|&d| d != b'0') {
        Some(p) => &int[p..],
        None => b"0",
    };
    let frac = match frac.iter().rposition(|&d| d != b'0') {
        Some(p) => &frac[..=p],
        None => b"",
    };
    let zero = int == b"0" && frac.is_empty();
    let mut s = String::with_capacity(int.len() + frac.len() + 2);
    if negative && !zero {
        s.push('-');
    }
    // Only ASCII digits reach here.
    s.extend(int.iter().map(|&d| char::from(d)));
    if !frac.is_empty() {
        s.push('.');
        s.extend(frac.iter().map(|&d| char::from(d)));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extraction_table() {
        let cases: &[(&str, Option<&str>)] = &[
            ("72", Some("72")),
            ("The answer is 72.", Some("72")),
            ("The answer is $1,234.", Some("1234")),
            ("so 3 + 4 = 7 apples", Some("7")),
            ("#### 72", Some("72")),
            ("first 5 then #### 1,000,000 and 9 more", Some("1000000")),
            ("\\boxed{42} but then 7", Some("42")),
            ("\\boxed{1,234}", Some("1234")),
            ("\\boxed{\\$18.00}", Some("18")),
            ("\\boxed{x = 5 \\text{ apples}}", Some("5")),
            ("\\boxed{-3}", Some("-3")),
            ("\\boxed{1} then \\boxed{2}", Some("2")),
            ("#### 5 then \\boxed{6}", Some("6")),
            ("the answer is 5 #### 6", Some("6")),
            ("Answer: 12 dollars", Some("12")),
            ("The ANSWER IS -4 degrees", Some("-4")),
            ("answer is 72.0", Some("72")),
            ("answer is 0.50", Some("0.5")),
            ("answer is 007", Some("7")),
            ("It costs 25% more: 50%", Some("50")),
            ("5kg", Some("5")),
            ("16-3-4=9", Some("9")),
            ("16-3", Some("3")),
            ("x = -8", Some("-8")),
            ("(-8)", Some("-8")),
            ("a-8", Some("8")),
            ("lost -$5", Some("-5")),
            ("temperature \u{2212}7", Some("-7")),
            ("-0", Some("0")),
            ("-0.000", Some("0")),
            ("1,23", Some("23")),
            ("2,3,4", Some("4")),
            ("1234,567", Some("567")),
            ("Total: 1,234.56.", Some("1234.56")),
            ("The answer is below.\n42", Some("42")),
            ("", None),
            ("no numbers here", None),
            ("\\boxed{", None),
            ("\\boxed{}", None),
            ("}}}{{{\\boxed{{{7", Some("7")),
            ("####", None),
            ("日本語 ✓ 🎉 ５", None),
            ("日本語 12 ✓", Some("12")),
            ("\u{0}\u{1}3\u{7f}", Some("3")),
        ];
        for (text, want) in cases {
            assert_eq!(
                extract_final_number(text).as_deref(),
                *want,
                "extract_final_number({text:?})"
            );
        }
    }

    #[test]
    fn explicit_needs_a_marker() {
        assert_eq!(explicit_final_number("3 + 4 = 7"), None);
        assert_eq!(explicit_final_number("answer is coming"), None);
        assert_eq!(
            explicit_final_number("The answer is 7.").as_deref(),
            Some("7")
        );
    }

    #[test]
    fn huge_numbers_stay_exact() {
        let big = "9".repeat(1000);
        assert_eq!(extract_final_number(&big).as_deref(), Some(big.as_str()));
        let bigger = format!("1{}", "0".repeat(1000));
        assert!(!numbers_equal(&big, &bigger));
        assert!(numbers_equal(&format!("{big}.000"), &big));
        // A long run of separators is linear, not a problem.
        let grouped = format!("1{}", ",000".repeat(10_000));
        assert_eq!(
            extract_final_number(&grouped).map(|s| s.len()),
            Some(30_001)
        );
    }

    #[test]
    fn canonical_table() {
        let cases: &[(&str, Option<&str>)] = &[
            ("72", Some("72")),
            (" 72 ", Some("72")),
            ("+72", Some("72")),
            ("072", Some("72")),
            ("72.0", Some("72")),
            ("72.", Some("72")),
            ("$72", Some("72")),
            ("-$72", Some("-72")),
            ("-72", Some("-72")),
            ("50%", Some("50")),
            ("1,234", Some("1234")),
            ("1,234,567.890", Some("1234567.89")),
            ("72 apples", None),
            ("7 2", None),
            ("", None),
            ("-", None),
            ("abc", None),
            ("x72", None),
        ];
        for (text, want) in cases {
            assert_eq!(canonical_number(text).as_deref(), *want, "{text:?}");
        }
    }

    #[test]
    fn equality() {
        assert!(numbers_equal("72", "72.00"));
        assert!(numbers_equal("1,234", "1234"));
        assert!(numbers_equal("-0", "0"));
        assert!(!numbers_equal("72", "-72"));
        assert!(!numbers_equal("0.1", "0.10000000000000001"));
        assert!(!numbers_equal("", ""));
    }
}
