//! CUDA source for the report: a small C++/CUDA highlighter (comments, strings, preprocessor
//! lines, keywords, types, CUDA qualifiers and builtins, numbers) that emits one HTML line per
//! source line with short CSS classes, and a side-by-side diff (through `similar`) of two
//! rendered variants that shows only the changed hunks with their context.

use std::fmt::Write;

use similar::{DiffTag, TextDiff};

use super::svg::esc;

const KEYWORDS: &[&str] = &[
    "asm",
    "auto",
    "break",
    "case",
    "const",
    "constexpr",
    "continue",
    "default",
    "do",
    "else",
    "enum",
    "extern",
    "false",
    "for",
    "goto",
    "if",
    "inline",
    "namespace",
    "nullptr",
    "register",
    "return",
    "sizeof",
    "static",
    "static_assert",
    "struct",
    "switch",
    "template",
    "true",
    "typedef",
    "typename",
    "union",
    "using",
    "volatile",
    "while",
];

const TYPES: &[&str] = &[
    "bool",
    "char",
    "dim3",
    "double",
    "float",
    "float2",
    "float4",
    "half",
    "half2",
    "int",
    "int2",
    "int4",
    "int8_t",
    "int16_t",
    "int32_t",
    "int64_t",
    "long",
    "nv_bfloat16",
    "nv_bfloat162",
    "short",
    "signed",
    "size_t",
    "uint2",
    "uint4",
    "uint8_t",
    "uint16_t",
    "uint32_t",
    "uint64_t",
    "unsigned",
    "void",
];

const BUILTINS: &[&str] = &["blockDim", "blockIdx", "gridDim", "threadIdx", "warpSize"];

/// Which class an identifier gets, if any.
fn word_class(word: &str) -> Option<&'static str> {
    if KEYWORDS.contains(&word) {
        Some("k")
    } else if TYPES.contains(&word) || word.ends_with("_t") {
        Some("t")
    } else if word.starts_with("__") || BUILTINS.contains(&word) {
        Some("b")
    } else {
        None
    }
}

fn span(out: &mut String, class: &str, text: &str) {
    // Unquoted one-letter classes: valid HTML, and a third of the bytes a listing adds.
    let _ = write!(out, "<span class={class}>{}</span>", esc_text(text));
}

/// Escapes text between tags: `&`, `<` and `>` only (quotes need no escape outside attributes,
/// and CUDA's strings are full of them).
fn esc_text(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Highlights `source`: one HTML string per line (block comments carry over line ends).
pub fn highlight(source: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut in_comment = false;
    for line in source.lines() {
        let mut out = String::with_capacity(line.len() + 32);
        let chars: Vec<char> = line.chars().collect();
        let mut i = 0;
        if in_comment {
            let end = find(&chars, 0, "*/").map(|e| e + 2).unwrap_or(chars.len());
            span(&mut out, "c", &collect(&chars[..end]));
            in_comment = end == chars.len() && !line.ends_with("*/");
            i = end;
        } else if line.trim_start().starts_with('#') {
            span(&mut out, "p", line);
            lines.push(out);
            continue;
        }
        while i < chars.len() {
            let c = chars[i];
            let next = chars.get(i + 1).copied();
            if c == '/' && next == Some('/') {
                span(&mut out, "c", &collect(&chars[i..]));
                break;
            } else if c == '/' && next == Some('*') {
                match find(&chars, i + 2, "*/") {
                    Some(e) => {
                        span(&mut out, "c", &collect(&chars[i..e + 2]));
                        i = e + 2;
                    }
                    None => {
                        span(&mut out, "c", &collect(&chars[i..]));
                        in_comment = true;
                        break;
                    }
                }
            } else if c == '"' || c == '\'' {
                let mut j = i + 1;
                while j < chars.len() && chars[j] != c {
                    j += if chars[j] == '\\' { 2 } else { 1 };
                }
                let end = (j + 1).min(chars.len());
                span(&mut out, "s", &collect(&chars[i..end]));
                i = end;
            } else if c.is_ascii_digit() || (c == '.' && next.is_some_and(|n| n.is_ascii_digit())) {
                let mut j = i + 1;
                while j < chars.len() {
                    let d = chars[j];
                    let exponent_sign =
                        (d == '+' || d == '-') && matches!(chars[j - 1], 'e' | 'E') && !is_hex(&chars[i..j]);
                    if d.is_ascii_alphanumeric() || d == '.' || exponent_sign {
                        j += 1;
                    } else {
                        break;
                    }
                }
                span(&mut out, "n", &collect(&chars[i..j]));
                i = j;
            } else if c.is_ascii_alphabetic() || c == '_' {
                let mut j = i + 1;
                while j < chars.len() && (chars[j].is_ascii_alphanumeric() || chars[j] == '_') {
                    j += 1;
                }
                let word = collect(&chars[i..j]);
                match word_class(&word) {
                    Some(class) => span(&mut out, class, &word),
                    None => out.push_str(&word),
                }
                i = j;
            } else {
                let mut j = i + 1;
                while j < chars.len()
                    && !chars[j].is_ascii_alphanumeric()
                    && !matches!(chars[j], '_' | '"' | '\'' | '/' | '.')
                {
                    j += 1;
                }
                out.push_str(&esc_text(&collect(&chars[i..j])));
                i = j;
            }
        }
        lines.push(out);
    }
    lines
}

fn is_hex(number: &[char]) -> bool {
    number.len() > 1 && number[0] == '0' && matches!(number[1], 'x' | 'X')
}

fn collect(chars: &[char]) -> String {
    chars.iter().collect()
}

fn find(chars: &[char], from: usize, pat: &str) -> Option<usize> {
    let p: Vec<char> = pat.chars().collect();
    (from..chars.len().saturating_sub(p.len() - 1)).find(|&i| chars[i..i + p.len()] == p[..])
}

/// The text of a highlighted line that is all comment (one `c` span), to carry the class on
/// the element that holds the line instead: about a third of a template's lines are its notes.
fn whole_comment(line: &str) -> Option<&str> {
    line.strip_prefix("<span class=c>")
        .and_then(|rest| rest.strip_suffix("</span>"))
        .filter(|text| !text.contains("<span"))
}

/// A highlighted listing with line numbers (an ordered list: numbers are not copied with the
/// code).
pub fn listing(source: &str) -> String {
    let lines = highlight(source);
    let mut out = String::with_capacity(source.len() * 2);
    out.push_str("<ol class=\"src\">");
    for l in &lines {
        match whole_comment(l) {
            Some(text) => {
                out.push_str("<li class=c>");
                out.push_str(text);
            }
            _ => {
                out.push_str("<li>");
                out.push_str(l);
            }
        }
        out.push('\n');
    }
    out.push_str("</ol>");
    out
}

/// How two sources differ, for the page's summary line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiffStats {
    pub removed: usize,
    pub added: usize,
}

/// A side-by-side diff of `old` (left) and `new` (right): changed hunks with `context` lines
/// around them, highlighted, unchanged stretches folded into one row each. A row is four plain
/// cells (the stylesheet tells line numbers from text by their column); only removed, added and
/// missing lines carry a class, so that a site with a diff per winner stays small.
pub fn side_by_side(old: &str, new: &str, old_title: &str, new_title: &str, context: usize) -> (String, DiffStats) {
    let (old_hl, new_hl) = (highlight(old), highlight(new));
    let diff = TextDiff::configure()
        .timeout(std::time::Duration::from_secs(2))
        .diff_lines(old, new);
    let mut stats = DiffStats { removed: 0, added: 0 };
    let mut out = String::new();
    let _ = write!(
        out,
        "<table class=\"diff\"><colgroup><col class=\"ln\"><col><col class=\"ln\"><col></colgroup><thead><tr><th colspan=\"2\">{}</th><th colspan=\"2\">{}</th></tr></thead><tbody>",
        esc(old_title),
        esc(new_title)
    );
    // `class`: "" for an unchanged line, else "del" or "ins"; a line that is all comment takes
    // the comment's class on its cell.
    let cell = |out: &mut String, lines: &[String], i: Option<usize>, class: &str| match i {
        Some(i) => {
            let line = lines.get(i).map(String::as_str).unwrap_or("");
            let (classes, text) = match whole_comment(line) {
                Some(text) if class.is_empty() => (" class=c".to_string(), text),
                Some(text) => (format!(" class=\"{class} c\""), text),
                None if class.is_empty() => (String::new(), line),
                None => (format!(" class={class}"), line),
            };
            let _ = write!(out, "<td>{}</td><td{classes}>{text}</td>", i + 1);
        }
        None => out.push_str("<td></td><td class=none></td>"),
    };
    let mut shown_old = 0;
    let groups = diff.grouped_ops(context);
    for group in &groups {
        let Some(first) = group.first() else { continue };
        let start = first.old_range().start;
        if start > shown_old {
            let _ = write!(
                out,
                "<tr class=\"gap\"><td colspan=\"4\">⋯ {} unchanged lines</td></tr>",
                start - shown_old
            );
        }
        for op in group {
            let (tag, o, n) = op.as_tag_tuple();
            match tag {
                DiffTag::Equal => {
                    for (a, b) in o.clone().zip(n.clone()) {
                        out.push_str("<tr>");
                        cell(&mut out, &old_hl, Some(a), "");
                        cell(&mut out, &new_hl, Some(b), "");
                        out.push_str("</tr>");
                    }
                }
                DiffTag::Delete | DiffTag::Insert | DiffTag::Replace => {
                    stats.removed += o.len();
                    stats.added += n.len();
                    for k in 0..o.len().max(n.len()) {
                        out.push_str("<tr>");
                        cell(&mut out, &old_hl, (k < o.len()).then(|| o.start + k), "del");
                        cell(&mut out, &new_hl, (k < n.len()).then(|| n.start + k), "ins");
                        out.push_str("</tr>");
                    }
                }
            }
            shown_old = o.end;
        }
    }
    let total = old.lines().count();
    if groups.is_empty() {
        out.push_str("<tr class=\"gap\"><td colspan=\"4\">the two sources are identical</td></tr>");
    } else if total > shown_old {
        let _ = write!(
            out,
            "<tr class=\"gap\"><td colspan=\"4\">⋯ {} unchanged lines</td></tr>",
            total - shown_old
        );
    }
    out.push_str("</tbody></table>");
    (out, stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn highlights_cuda_tokens() {
        let src = "#include <cuda_fp16.h>\nextern \"C\" __global__ void k(const float* x) { // hi\n  int i = threadIdx.x + 4; /* a\n  b */ float y = 1.5e-3f;\n}";
        let lines = highlight(src);
        assert_eq!(lines.len(), 5);
        assert_eq!(lines[0], "<span class=p>#include &lt;cuda_fp16.h&gt;</span>");
        assert!(lines[1].contains("<span class=s>\"C\"</span>"), "{}", lines[1]);
        assert!(lines[1].contains("<span class=b>__global__</span>"));
        assert!(lines[1].contains("<span class=t>void</span>") && lines[1].contains("<span class=k>const</span>"));
        assert!(lines[1].ends_with("<span class=c>// hi</span>"));
        assert!(lines[2].contains("<span class=b>threadIdx</span>") && lines[2].contains("<span class=n>4</span>"));
        assert!(lines[2].ends_with("<span class=c>/* a</span>"), "{}", lines[2]);
        assert!(lines[3].starts_with("<span class=c>  b */</span>"), "{}", lines[3]);
        assert!(lines[3].contains("<span class=n>1.5e-3f</span>"), "{}", lines[3]);
    }

    #[test]
    fn odd_input_never_panics() {
        for src in [
            "\"unterminated",
            "'",
            "/*",
            "a /* b",
            "0x1e-3",
            "é ü 漢字 \\",
            "",
            "\n\n",
            "*/",
        ] {
            let _ = highlight(src);
            let _ = listing(src);
        }
    }

    #[test]
    fn diff_shows_changed_hunks_only() {
        let old: String = (0..100).map(|i| format!("line {i};\n")).collect();
        let new = old.replace("line 50;", "line fifty;");
        let (html, stats) = side_by_side(&old, &new, "default", "winner", 2);
        assert_eq!(stats, DiffStats { removed: 1, added: 1 });
        assert!(
            html.contains("⋯ 48 unchanged lines") && html.contains("⋯ 47 unchanged lines"),
            "{html}"
        );
        assert!(html.contains("fifty"));
        assert_eq!(
            html.matches("<tr>").count(),
            1 + 5,
            "the header, the change and two lines each side"
        );
        let (same, s) = side_by_side(&old, &old, "a", "b", 3);
        assert_eq!(s, DiffStats { removed: 0, added: 0 });
        assert!(same.contains("identical"));
    }
}
