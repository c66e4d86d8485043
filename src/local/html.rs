//! Text into HTML, for the report's pages.

/// `s` with `&`, `<` and `>` escaped.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
