//! Final answers in LaTeX, as MATH-style solutions state them: finding the
//! last `\boxed{...}` of a completion, and deciding whether two answers say
//! the same thing.
//!
//! Both answers are normalised (in the tradition of the MATH data set's own
//! `strip_string`, with more cases) and then compared: exactly as rational
//! numbers when both are numbers (`0.5` = `\frac{1}{2}` = `1/2`), element by
//! element when both are tuples, intervals, sets or comma lists, and as text
//! otherwise. Nothing is evaluated symbolically: `\frac{\sqrt3}2` matches
//! `\frac{\sqrt{3}}{2}` because both normalise to the same text, but
//! `\sqrt{12}` does not match `2\sqrt{3}`. A missed equivalence costs a
//! right answer its reward, while a false one would pay for a wrong answer,
//! so every rule here is a rewriting that cannot change an answer's value.
//!
//! Normalisation works on LaTeX tokens rather than on text, so that
//! removing one thing cannot glue its neighbours into another (`\pi r` stays
//! two tokens) and so that it is idempotent: a normalised answer normalises
//! to itself.

use super::expr::{Op, Ratio};
use super::numeric::canonical_number;

/// The longest answer (box content or reference) that is compared, in
/// bytes; a longer one never matches. No reference answer comes near it,
/// and the bound keeps the cost of scoring a completion small whatever the
/// policy writes.
pub const MAX_ANSWER_LEN: usize = 1024;

/// How deep the normalisation follows nested groups and collections (it
/// recurses once per level, so this bounds its stack).
const MAX_DEPTH: usize = 16;

/// The macros that box a final answer.
const BOX_MACROS: [&str; 2] = ["\\boxed", "\\fbox"];

/// Text macros: their content is text (unwrapped), or a unit when it ends an
/// answer after a value (dropped).
const TEXT_MACROS: &[&str] = &[
    "\\text",
    "\\textbf",
    "\\textit",
    "\\textrm",
    "\\textup",
    "\\textnormal",
    "\\mbox",
    "\\mathrm",
    "\\mathbf",
    "\\mathit",
];

/// Control words that only change how an answer looks.
const DECORATION_WORDS: &[&str] = &[
    "\\left",
    "\\right",
    "\\big",
    "\\Big",
    "\\bigl",
    "\\bigr",
    "\\Bigl",
    "\\Bigr",
    "\\quad",
    "\\qquad",
    "\\displaystyle",
    "\\textstyle",
    "\\degree",
];

/// Macros whose arguments are given braces when written without
/// (`\frac12` → `\frac{1}{2}`), with how many they take.
const ARG_MACROS: &[(&str, usize)] = &[("\\frac", 2), ("\\sqrt", 1), ("\\binom", 2)];

/// Control words that end a value, so a `\text{}` after them is a unit.
const VALUE_WORDS: &[&str] = &["\\pi", "\\infty"];

/// The content of the last `\boxed{...}` or `\fbox{...}` in a text, braces
/// balanced; `\boxed 5` (a space, no braces) gives the token after the
/// space. `None` when there is no box, or when the last one is never closed
/// (a truncated completion states no answer).
pub fn last_boxed(text: &str) -> Option<&str> {
    let start = BOX_MACROS
        .iter()
        .filter_map(|m| text.rfind(m).map(|i| i + m.len()))
        .max()?;
    let rest = &text[start..];
    let after = rest.trim_start_matches(' ');
    if let Some(body) = after.strip_prefix('{') {
        return group_body(body);
    }
    if after.len() == rest.len() {
        // `\boxedx`: another macro, or `\boxed` at the very end.
        return None;
    }
    let end = after
        .find(|c: char| c.is_whitespace() || c == '$')
        .unwrap_or(after.len());
    Some(&after[..end]).filter(|token| !token.is_empty())
}

/// The text up to the `}` that closes a group whose `{` is just before it.
/// Escaped braces (`\{1, 2\}`) are characters, not grouping, as in TeX and
/// as the normalisation's tokens see them.
fn group_body(body: &str) -> Option<&str> {
    let mut depth = 0usize;
    let mut bytes = body.bytes().enumerate();
    while let Some((i, b)) = bytes.next() {
        match b {
            // Whatever follows a backslash is escaped; a multi-byte
            // character's other bytes are never a brace.
            b'\\' => {
                bytes.next();
            }
            b'{' => depth += 1,
            // `}` is ASCII, so `i` is a character boundary.
            b'}' if depth == 0 => return Some(&body[..i]),
            b'}' => depth -= 1,
            _ => {}
        }
    }
    None
}

/// Whether a completion's boxed answer `got` says what `reference` says
/// (both normalised, then [`equivalent`]).
pub fn answers_match(got: &str, reference: &str) -> bool {
    match (normalize(got), normalize(reference)) {
        (Some(got), Some(reference)) => equivalent(&got, &reference),
        _ => false,
    }
}

/// Whether two normalised answers are the same: equal text, the same exact
/// number, or collections whose elements are the same in turn (in order for
/// tuples and intervals, in any order for sets and bare lists). An empty
/// answer matches nothing.
pub fn equivalent(a: &str, b: &str) -> bool {
    !a.is_empty() && !b.is_empty() && (a == b || answer_key(a, 0) == answer_key(b, 0))
}

/// The normal form of an answer: decoration, spacing, `$`, `\left`/`\right`,
/// degrees, percent signs, trailing units and full stops gone; `\dfrac` and
/// `\tfrac` as `\frac`; text macros unwrapped; a leading `x =` or `x \in`
/// dropped; arguments braced (`\sqrt2` → `\sqrt{2}`). `Some("")` for an
/// answer that says nothing, `None` for one over [`MAX_ANSWER_LEN`].
pub fn normalize(answer: &str) -> Option<String> {
    if answer.len() > MAX_ANSWER_LEN {
        return None;
    }
    let mut tokens = tokenize(answer);
    // Each step only removes tokens (or renames `\dfrac`), and one step's
    // removal can expose work for another (`{x = 3}`), so they run until
    // nothing changes: that is what makes the result normalise to itself.
    loop {
        let next = peel(unwrap_text(&decorate(tokens.clone()), 0));
        if next == tokens {
            break;
        }
        tokens = next;
    }
    Some(render(&brace_arguments(&tokens, 0)))
}

/// A LaTeX token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tok<'a> {
    /// A control word, backslash included: `\frac`.
    Word(&'a str),
    /// A control symbol: a backslash and one other character (`\{`, `\,`).
    Sym(&'a str),
    /// Any other character.
    Char(char),
    /// A run of whitespace.
    Space,
}

fn tokenize(s: &str) -> Vec<Tok<'_>> {
    let mut tokens = Vec::new();
    let mut chars = s.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c.is_whitespace() {
            if tokens.last() != Some(&Tok::Space) {
                tokens.push(Tok::Space);
            }
            continue;
        }
        if c != '\\' {
            tokens.push(Tok::Char(c));
            continue;
        }
        match chars.peek().copied() {
            Some((_, n)) if n.is_ascii_alphabetic() => {
                let mut end = i + 1;
                while let Some(&(j, n)) = chars.peek() {
                    if !n.is_ascii_alphabetic() {
                        break;
                    }
                    end = j + 1;
                    chars.next();
                }
                tokens.push(Tok::Word(&s[i..end]));
            }
            Some((j, n)) => {
                chars.next();
                tokens.push(Tok::Sym(&s[i..j + n.len_utf8()]));
            }
            // A backslash that ends the text escapes nothing: dropped.
            None => {}
        }
    }
    tokens
}

/// Tokens back to text; a control word followed by a letter keeps a space,
/// or the letter would join its name.
fn render(tokens: &[Tok]) -> String {
    let mut out = String::new();
    for (i, t) in tokens.iter().enumerate() {
        match t {
            Tok::Word(w) => {
                out.push_str(w);
                if matches!(tokens.get(i + 1), Some(Tok::Char(c)) if c.is_ascii_alphabetic()) {
                    out.push(' ');
                }
            }
            Tok::Sym(s) => out.push_str(s),
            Tok::Char(c) => out.push(*c),
            Tok::Space => out.push(' '),
        }
    }
    out
}

/// Whether a token only changes how an answer looks: spacing, `$`, percent
/// and degree signs, `\left`, `\right` and the like.
fn is_decoration(t: &Tok) -> bool {
    match t {
        Tok::Space => true,
        Tok::Char(c) => matches!(c, '$' | '%' | '°' | '~'),
        Tok::Sym(s) => {
            let symbol = &s[1..];
            matches!(symbol, "!" | "," | ";" | ":" | ">" | "$" | "%")
                || symbol.chars().all(char::is_whitespace)
        }
        Tok::Word(w) => DECORATION_WORDS.contains(w),
    }
}

/// Drops decoration, spells every fraction `\frac`, and removes degree
/// marks (`^\circ`, `^{\circ}`) and braced thousands separators (`{,}`).
fn decorate(tokens: Vec<Tok<'_>>) -> Vec<Tok<'_>> {
    let kept: Vec<Tok> = tokens
        .into_iter()
        .filter(|t| !is_decoration(t))
        .map(|t| match t {
            Tok::Word("\\dfrac" | "\\tfrac" | "\\cfrac") => Tok::Word("\\frac"),
            other => other,
        })
        .collect();
    let mut out = Vec::with_capacity(kept.len());
    let mut i = 0;
    while i < kept.len() {
        match &kept[i..] {
            [Tok::Char('^'), Tok::Word("\\circ"), ..] => i += 2,
            [
                Tok::Char('^'),
                Tok::Char('{'),
                Tok::Word("\\circ"),
                Tok::Char('}'),
                ..,
            ] => i += 4,
            [Tok::Char('{'), Tok::Char(','), Tok::Char('}'), ..] => {
                out.push(Tok::Char(','));
                i += 3;
            }
            _ => {
                out.push(kept[i]);
                i += 1;
            }
        }
    }
    out
}

/// Unwraps text macros (`\text{Monday}` → `Monday`), and drops one that is
/// a trailing unit together with its power (`5\text{ cm}^2` → `5`).
fn unwrap_text<'a>(tokens: &[Tok<'a>], depth: usize) -> Vec<Tok<'a>> {
    let mut out = Vec::with_capacity(tokens.len());
    let mut i = 0;
    while i < tokens.len() {
        let t = tokens[i];
        let close = match t {
            Tok::Word(w)
                if TEXT_MACROS.contains(&w) && tokens.get(i + 1) == Some(&Tok::Char('{')) =>
            {
                group_end(tokens, i + 1)
            }
            _ => None,
        };
        let Some(close) = close else {
            out.push(t);
            i += 1;
            continue;
        };
        let inner = &tokens[i + 2..close];
        if is_unit(&out, inner, &tokens[close + 1..]) {
            return out;
        }
        if depth < MAX_DEPTH {
            out.extend(unwrap_text(inner, depth + 1));
        } else {
            out.extend_from_slice(inner);
        }
        i = close + 1;
    }
    out
}

/// The index of the `}` that closes the `{` at `open`.
fn group_end(tokens: &[Tok], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, t) in tokens.iter().enumerate().skip(open) {
        match t {
            Tok::Char('{') => depth += 1,
            Tok::Char('}') if depth <= 1 => return Some(i),
            Tok::Char('}') => depth -= 1,
            _ => {}
        }
    }
    None
}

/// Whether a text macro holding `inner` is a unit: it follows a value,
/// holds a word, and nothing but a power or full stops comes after it.
fn is_unit(before: &[Tok], inner: &[Tok], after: &[Tok]) -> bool {
    let follows_value = match before.last() {
        Some(Tok::Char(c)) => c.is_alphanumeric() || matches!(c, ')' | ']' | '}' | '!'),
        Some(Tok::Word(w)) => VALUE_WORDS.contains(w),
        _ => false,
    };
    let is_letter = |t: &Tok| matches!(t, Tok::Char(c) if c.is_alphabetic());
    let unit_like = |t: &Tok| matches!(t, Tok::Char(c) if c.is_alphanumeric() || matches!(c, '.' | '/' | '^' | '{' | '}' | '-'));
    follows_value && inner.iter().any(is_letter) && inner.iter().all(unit_like) && is_power(after)
}

/// Nothing, or `^2` / `^{2}`, with any full stops after it.
fn is_power(tokens: &[Tok]) -> bool {
    let end = tokens
        .iter()
        .rposition(|t| *t != Tok::Char('.'))
        .map_or(0, |p| p + 1);
    let digit = |t: &Tok| matches!(t, Tok::Char(d) if d.is_ascii_digit());
    match &tokens[..end] {
        [] => true,
        [Tok::Char('^'), d] => digit(d),
        [Tok::Char('^'), Tok::Char('{'), ds @ .., Tok::Char('}')] => {
            !ds.is_empty() && ds.iter().all(digit)
        }
        _ => false,
    }
}

/// Strips what surrounds an answer: trailing full stops, braces around the
/// whole, and a leading variable (`x =`, `x \in`), until none is left.
fn peel(mut tokens: Vec<Tok<'_>>) -> Vec<Tok<'_>> {
    loop {
        let before = tokens.len();
        while tokens.last() == Some(&Tok::Char('.')) {
            tokens.pop();
        }
        if tokens.first() == Some(&Tok::Char('{'))
            && group_end(&tokens, 0) == Some(tokens.len() - 1)
        {
            tokens.pop();
            tokens.remove(0);
        }
        if let Some(at) = variable_end(&tokens) {
            tokens.drain(..at);
        }
        if tokens.len() == before {
            return tokens;
        }
    }
}

/// Where the value starts in `x = 3` or `x \in (0, 1)`: after the only
/// relation, when what comes before it is a variable's name and something
/// comes after it.
fn variable_end(tokens: &[Tok]) -> Option<usize> {
    let is_relation = |t: &Tok| matches!(t, Tok::Char('=') | Tok::Word("\\in"));
    let mut relations = tokens
        .iter()
        .enumerate()
        .filter(|(_, t)| is_relation(t))
        .map(|(i, _)| i);
    let at = relations.next()?;
    let only = relations.next().is_none();
    (only && at + 1 < tokens.len() && is_variable(&tokens[..at])).then_some(at + 1)
}

/// A variable's name: a letter or a macro (`x`, `\theta`), with one more
/// letter or digit (`AB`, `x1`) or a subscript (`x_1`, `x_{12}`).
fn is_variable(tokens: &[Tok]) -> bool {
    let Some((head, rest)) = tokens.split_first() else {
        return false;
    };
    let head_ok = match head {
        Tok::Char(c) => c.is_ascii_alphabetic(),
        Tok::Word(w) => !TEXT_MACROS.contains(w) && !ARG_MACROS.iter().any(|(m, _)| m == w),
        _ => false,
    };
    let alnum = |t: &Tok| matches!(t, Tok::Char(c) if c.is_ascii_alphanumeric());
    head_ok
        && match rest {
            [] => true,
            [one] | [Tok::Char('_'), one] => alnum(one),
            [Tok::Char('_'), Tok::Char('{'), inner @ .., Tok::Char('}')] => {
                !inner.is_empty() && inner.iter().all(alnum)
            }
            _ => false,
        }
}

/// Braces the arguments of `\frac`, `\sqrt` and `\binom` that were written
/// without (`\frac12`, `\sqrt2`, `\frac\pi2`): one token each, as in TeX.
fn brace_arguments<'a>(tokens: &[Tok<'a>], depth: usize) -> Vec<Tok<'a>> {
    let mut out = Vec::with_capacity(tokens.len() + 4);
    let mut i = 0;
    while i < tokens.len() {
        let t = tokens[i];
        out.push(t);
        i += 1;
        let Tok::Word(w) = t else { continue };
        let Some(&(_, arity)) = ARG_MACROS.iter().find(|(m, _)| *m == w) else {
            continue;
        };
        if w == "\\sqrt" && tokens.get(i) == Some(&Tok::Char('[')) {
            // `\sqrt[3]{x}`: the index is copied as it is.
            let close = tokens[i..]
                .iter()
                .position(|t| *t == Tok::Char(']'))
                .map_or(tokens.len(), |p| i + p + 1);
            out.extend_from_slice(&tokens[i..close]);
            i = close;
        }
        for _ in 0..arity {
            match tokens.get(i) {
                Some(Tok::Char('{')) => {
                    // An unclosed group is left for the loop to copy.
                    let Some(close) = group_end(tokens, i) else {
                        break;
                    };
                    let inner = &tokens[i + 1..close];
                    out.push(Tok::Char('{'));
                    if depth < MAX_DEPTH {
                        out.extend(brace_arguments(inner, depth + 1));
                    } else {
                        out.extend_from_slice(inner);
                    }
                    out.push(Tok::Char('}'));
                    i = close + 1;
                }
                // A closing brace or the end: the argument is missing.
                None | Some(Tok::Char('}')) => break,
                Some(&arg) => {
                    out.extend([Tok::Char('{'), arg, Tok::Char('}')]);
                    i += 1;
                }
            }
        }
    }
    out
}

/// What two equivalent normalised answers share: a number's exact value, a
/// collection's element keys (sorted when order does not matter), or the
/// text itself.
fn answer_key(s: &str, depth: usize) -> String {
    if let Some(key) = number_key(s) {
        return key;
    }
    if depth < MAX_DEPTH
        && let Some(c) = collection(s)
    {
        let mut keys: Vec<String> = c.items.iter().map(|i| answer_key(i, depth + 1)).collect();
        if !c.ordered {
            keys.sort_unstable();
        }
        return format!("{}{}{}", c.open, keys.join(","), c.close);
    }
    s.to_string()
}

/// A number's value as a key: `num/den` in lowest terms, or the canonical
/// decimal when it is too big for that (it has no `/`, so the two kinds
/// never meet). The number is a decimal (`1,000`, `.5`, `2.50`) or a
/// fraction of two (`a/b`, `\frac{a}{b}`), with an optional sign before.
fn number_key(s: &str) -> Option<String> {
    let (negative, body) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    if body.starts_with(['-', '+']) {
        return None;
    }
    let value = match fraction_parts(body) {
        Some((a, b)) => {
            let (Value::Exact(a), Value::Exact(b)) = (decimal(a)?, decimal(b)?) else {
                return None;
            };
            Value::Exact(Op::Div.apply(a, b).ok()?)
        }
        None => decimal(body)?,
    };
    Some(match value {
        Value::Exact(r) => {
            let num = if negative {
                r.num.checked_neg()?
            } else {
                r.num
            };
            format!("{num}/{}", r.den)
        }
        Value::Big(digits) if negative => match digits.strip_prefix('-') {
            Some(positive) => positive.to_string(),
            None => format!("-{digits}"),
        },
        Value::Big(digits) => digits,
    })
}

/// The numerator and denominator texts of `\frac{a}{b}` or `a/b`.
fn fraction_parts(body: &str) -> Option<(&str, &str)> {
    match body.strip_prefix("\\frac{") {
        Some(args) => {
            let (a, rest) = args.split_once("}{")?;
            Some((a, rest.strip_suffix('}')?))
        }
        None => body.split_once('/'),
    }
}

/// A number's exact value, or its canonical digits when too big for one.
enum Value {
    Exact(Ratio),
    Big(String),
}

/// A decimal number (a leading `.` allowed), through
/// [`canonical_number`]'s reading of signs and thousands separators.
fn decimal(text: &str) -> Option<Value> {
    let fixed = if text.starts_with('.') {
        format!("0{text}")
    } else if let Some(rest) = text.strip_prefix("-.") {
        format!("-0.{rest}")
    } else {
        text.to_string()
    };
    let canonical = canonical_number(&fixed)?;
    Some(exact(&canonical).map_or(Value::Big(canonical), Value::Exact))
}

/// A canonical decimal (`[-]int[.frac]`) as a ratio, if it fits in `i128`.
fn exact(canonical: &str) -> Option<Ratio> {
    let (negative, digits) = match canonical.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, canonical),
    };
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    let scale = 10i128.checked_pow(u32::try_from(frac.len()).ok()?)?;
    let magnitude: i128 = format!("{int}{frac}").parse().ok()?;
    Ratio::new(if negative { -magnitude } else { magnitude }, scale).ok()
}

/// A bracketed or bare comma-separated collection.
struct Collection<'a> {
    open: &'a str,
    close: &'a str,
    items: Vec<&'a str>,
    /// Tuples and intervals are ordered; sets and bare lists are not.
    ordered: bool,
}

/// `(a,b)`, `[a,b)`, `\{a,b\}` (one bracketed group, whatever its
/// brackets), or a bare `a,b` with at least two elements.
fn collection(s: &str) -> Option<Collection<'_>> {
    let (open, close) = if s.starts_with("\\{") && s.ends_with("\\}") && s.len() >= 4 {
        ("\\{", "\\}")
    } else if s.starts_with(['(', '[']) && s.ends_with([')', ']']) && s.len() >= 2 {
        (&s[..1], &s[s.len() - 1..])
    } else {
        ("", "")
    };
    let inner = &s[open.len()..s.len() - close.len()];
    if !open.is_empty() && bracket_end(s, open.len() - 1) != Some(s.len() - 1) {
        // `(1)+(2)`: brackets at both ends, but not one group.
        return None;
    }
    let items = split_top_level(inner);
    if open.is_empty() && items.len() < 2 {
        return None;
    }
    Some(Collection {
        open,
        close,
        items,
        ordered: matches!(open, "(" | "["),
    })
}

/// The index of the bracket closing the one at `open`; brackets of all
/// kinds count alike, so an interval's `[0, 1)` closes.
fn bracket_end(s: &str, open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, b) in s.bytes().enumerate().skip(open) {
        match b {
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' if depth <= 1 => return Some(i),
            b')' | b']' | b'}' => depth -= 1,
            _ => {}
        }
    }
    None
}

/// The parts of a text between its commas outside any brackets.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, b) in s.bytes().enumerate() {
        match b {
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            // `,` is ASCII, so `i` is a character boundary.
            b',' if depth == 0 => {
                items.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&s[start..]);
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_boxed_table() {
        let cases: &[(&str, Option<&str>)] = &[
            ("so \\boxed{5}.", Some("5")),
            ("\\boxed{1} then \\boxed{2}", Some("2")),
            ("\\boxed{\\frac{1}{2}}", Some("\\frac{1}{2}")),
            ("\\boxed{{a}{b}} after", Some("{a}{b}")),
            ("$\\boxed 5$", Some("5")),
            ("\\boxed  {7}", Some("7")),
            ("\\fbox{3}", Some("3")),
            ("\\boxed{2} and \\fbox{3}", Some("3")),
            ("\\fbox{2} and \\boxed{3}", Some("3")),
            ("\\boxed{\\boxed{4}}", Some("4")),
            ("\\boxed{\\{1, 2\\}}", Some("\\{1, 2\\}")),
            ("\\boxed{\\}}", Some("\\}")),
            ("\\boxed{a\\\\}", Some("a\\\\")),
            ("\\boxed{a\\}", None),
            ("\\boxed{}", Some("")),
            ("日本\\boxed{語}", Some("語")),
            ("\\boxed{", None),
            ("\\boxed{5", None),
            ("\\boxed{5} then \\boxed{6", None),
            ("\\boxed", None),
            ("\\boxed ", None),
            ("\\boxedx{5}", None),
            ("no box at all", None),
            ("", None),
        ];
        for (text, want) in cases {
            assert_eq!(last_boxed(text), *want, "last_boxed({text:?})");
        }
    }

    /// (reference, boxed answer, whether they match).
    const MATCHES: &[(&str, &str, bool)] = &[
        // Fractions, decimals, exact rationals.
        ("\\frac{1}{2}", "\\frac12", true),
        ("\\frac{1}{2}", "\\dfrac{1}{2}", true),
        ("\\frac{1}{2}", "\\tfrac12", true),
        ("\\frac{1}{2}", "0.5", true),
        ("\\frac{1}{2}", "1/2", true),
        ("\\frac{1}{2}", "\\frac{2}{4}", true),
        ("0.5", ".5", true),
        ("-\\frac{1}{2}", "\\frac{-1}{2}", true),
        ("-\\frac{1}{2}", "-0.5", true),
        ("2.5", "2.50", true),
        ("12", "012", true),
        ("0", "-0", true),
        ("-3", "\u{2212}3", true),
        ("\\frac{1}{2}", "\\frac{1}{3}", false),
        ("\\frac{1}{3}", "0.333", false),
        ("\\frac{1}{3}", "0.3333333333", false),
        ("12", "1.2", false),
        ("3", "33", false),
        ("-5", "5", false),
        ("5", "\\frac{5}{0}", false),
        ("\\frac{1}{2}", "\\frac{1}{2}x", false),
        ("\\frac{1}{2}", "\\frac{1}{2", false),
        // Thousands separators.
        ("1000", "1,000", true),
        ("1000", "1{,}000", true),
        ("1000", "1\\,000", true),
        ("1000", "100", false),
        ("1,000", "0,1", false),
        // A leading variable.
        ("3", "x = 3", true),
        ("3", "x=3", true),
        ("x=3", "3", true),
        ("5", "a=5", true),
        ("7", "x_1 = 7", true),
        ("30", "\\theta = 30", true),
        ("[2,5]", "x \\in [2, 5]", true),
        ("x=3", "x=33", false),
        ("4", "x+1=4", false),
        // Decoration and units.
        ("5", "5\\text{ cm}", true),
        ("5", "5 \\text{cm}^2", true),
        ("10", "10\\mbox{ inches}", true),
        ("10", "10\\ \\text{dollars}.", true),
        ("90", "90^\\circ", true),
        ("90", "90^{\\circ}", true),
        ("50", "50\\%", true),
        ("18", "\\$18", true),
        ("18", "$18$", true),
        ("5", "5.", true),
        ("5", "{5}", true),
        ("\\text{Monday}", "Monday", true),
        ("\\text{(C)}", "\\textbf{(C)}", true),
        ("5", "5\\text{ and }6", false),
        ("2", "2^2", false),
        // Roots and symbols: same text after normalisation, never evaluated.
        ("\\sqrt{2}", "\\sqrt2", true),
        ("\\sqrt{2}", "\\sqrt 2", true),
        ("2\\sqrt{3}", "2 \\sqrt{3}", true),
        ("\\frac{\\sqrt{3}}{2}", "\\dfrac{\\sqrt3}2", true),
        ("\\frac{\\pi}{2}", "\\frac\\pi2", true),
        ("3\\pi", "3 \\pi", true),
        ("\\infty", "\\infty", true),
        ("\\sqrt{2}", "\\sqrt{3}", false),
        ("2\\sqrt{3}", "\\sqrt{12}", false),
        // Tuples, intervals, sets and lists.
        ("(1,2)", "(1, 2)", true),
        ("(1,2)", "\\left( 1, 2 \\right)", true),
        ("(\\frac{1}{2},3)", "(0.5, 3)", true),
        ("[0,1)", "[0, 1)", true),
        ("(-\\infty, 3]", "(-\\infty,3]", true),
        ("\\{1,2\\}", "\\{2, 1\\}", true),
        ("\\{1,2\\}", "\\left\\{ 2,1 \\right\\}", true),
        ("-2, 1", "1, -2", true),
        ("(1,2)", "(2,1)", false),
        ("[0,1)", "(0,1)", false),
        ("(1,2)", "[1,2]", false),
        ("\\{1,2\\}", "\\{1,2,3\\}", false),
        ("1,2", "1,2,2", false),
        // Nothing in the box.
        ("3", "", false),
        ("3", "   ", false),
        ("3", "\\text{ }", false),
        ("3", "$$", false),
    ];

    #[test]
    fn answer_table() {
        assert!(MATCHES.len() >= 40);
        for &(reference, got, want) in MATCHES {
            assert_eq!(
                answers_match(got, reference),
                want,
                "{got:?} vs {reference:?}: {:?} vs {:?}",
                normalize(got),
                normalize(reference)
            );
            // The relation is symmetric.
            assert_eq!(
                answers_match(reference, got),
                want,
                "{reference:?} vs {got:?}"
            );
        }
    }

    #[test]
    fn normal_forms() {
        let cases = [
            ("\\dfrac12", "\\frac{1}{2}"),
            ("\\sqrt2", "\\sqrt{2}"),
            ("\\sqrt[3]2", "\\sqrt[3]{2}"),
            ("\\pi r^2", "\\pi r^2"),
            ("\\left[ 1, 2 \\right)", "[1,2)"),
            ("x = \\text{ Monday }", "Monday"),
            ("{x = 3}.", "3"),
            ("10^\\circ\\text{C}", "10"),
            ("\\text{\\textbf{nested}}", "nested"),
            ("a\\", "a"),
        ];
        for (answer, want) in cases {
            assert_eq!(normalize(answer).as_deref(), Some(want), "{answer:?}");
        }
        let long = "1".repeat(MAX_ANSWER_LEN + 1);
        assert_eq!(normalize(&long), None);
        assert!(!answers_match(&long, &long), "too long never matches");
    }

    #[test]
    fn hostile_inputs_are_cheap_and_safe() {
        let deep = format!("{}1{}", "{".repeat(500), "}".repeat(500));
        assert_eq!(normalize(&deep).as_deref(), Some("1"));
        let fracs = "\\frac{".repeat(150);
        let _ = normalize(&fracs);
        let texts = "\\text{".repeat(150);
        let _ = normalize(&texts);
        let nested = format!("{}1{}", "(".repeat(400), ")".repeat(400));
        assert!(answers_match(&nested, &nested));
        let list = vec!["1"; 500].join(",");
        assert!(answers_match(&list, &list));
    }
}
