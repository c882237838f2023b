//! `reckon lab report DIR [--html]`: every leg found in DIR (a leg's output directory holds `command.txt`
//! and `table.md`, and its plots as `*.svg`) on one page: the machines and commits the legs ran on, then
//! per leg its command, its table and its plots. Markdown (`report.md`, plots linked) and, with `--html`,
//! one self-contained HTML file (`report.html`, plots inline as SVG, no outside resource).

use crate::LabError;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// One leg's output directory.
#[derive(Clone, Debug)]
pub struct Leg {
    /// Relative to the report's directory ("." for the directory itself).
    pub name: String,
    /// `kv-quant`, `eviction`, ... (the word after `lab` in the command), or "bench".
    pub kind: String,
    pub command: String,
    /// `commit: ...`, `cpu: ...` lines of the stamp.
    pub stamp: Vec<String>,
    pub table: String,
    /// File names and contents.
    pub plots: Vec<(String, String)>,
}

/// The legs in `dir` and in its subdirectories (two levels down), by name.
pub fn find_legs(dir: &Path) -> Result<Vec<Leg>, LabError> {
    let (mut dirs, mut frontier) = (vec![dir.to_path_buf()], vec![dir.to_path_buf()]);
    for _ in 0..2 {
        let mut next = Vec::new();
        for d in &frontier {
            for e in std::fs::read_dir(d)?.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    next.push(e.path());
                }
            }
        }
        dirs.extend(next.iter().cloned());
        frontier = next;
    }
    let mut legs = Vec::new();
    for d in dirs {
        if let Some(leg) = read_leg(dir, &d)? {
            legs.push(leg);
        }
    }
    legs.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(legs)
}

fn read_leg(root: &Path, d: &Path) -> Result<Option<Leg>, LabError> {
    let (command_file, table_file) = (d.join("command.txt"), d.join("table.md"));
    if !command_file.is_file() || !table_file.is_file() {
        return Ok(None);
    }
    let command_txt = std::fs::read_to_string(&command_file)?;
    let mut lines = command_txt.lines();
    let command = lines.next().unwrap_or("").trim().to_string();
    let stamp = lines.filter(|l| !l.trim().is_empty()).map(str::to_string).collect();
    let words: Vec<&str> = command.split_whitespace().collect();
    let kind = words.iter().position(|w| *w == "lab").and_then(|i| words.get(i + 1)).map_or("bench", |w| w).to_string();
    let mut plots: Vec<(String, String)> = Vec::new();
    for e in std::fs::read_dir(d)?.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "svg") {
            plots.push((file_name(&p), std::fs::read_to_string(&p)?));
        }
    }
    plots.sort();
    let name = d.strip_prefix(root).ok().map(|p| p.to_string_lossy().into_owned()).filter(|s| !s.is_empty()).unwrap_or_else(|| ".".into());
    Ok(Some(Leg { name, kind, command, stamp, table: std::fs::read_to_string(&table_file)?, plots }))
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
}

/// The distinct stamp lines of the legs (machines, commits, ISAs), in order of first appearance.
fn machines(legs: &[Leg]) -> Vec<String> {
    let mut seen: Vec<String> = Vec::new();
    for l in legs.iter().flat_map(|l| &l.stamp) {
        if !seen.contains(l) {
            seen.push(l.clone());
        }
    }
    seen
}

pub fn markdown(title: &str, legs: &[Leg]) -> String {
    let mut out = format!("# {title}\n\n");
    let _ = writeln!(out, "{} legs. Machines and builds they ran on:\n", legs.len());
    for m in machines(legs) {
        let _ = writeln!(out, "- {m}");
    }
    for leg in legs {
        let _ = writeln!(out, "\n## {} ({})\n\n```\n{}\n```\n", leg.kind, leg.name, leg.command);
        for s in &leg.stamp {
            let _ = writeln!(out, "- {s}");
        }
        let _ = writeln!(out, "\n{}", leg.table.trim_end());
        for (f, _) in &leg.plots {
            let _ = writeln!(out, "\n![{f}]({}/{f})", leg.name);
        }
    }
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Inline markdown of a table cell or a line: `code` and **bold**.
fn inline(s: &str) -> String {
    let mut out = String::new();
    for (i, part) in escape(s).split('`').enumerate() {
        if i % 2 == 1 {
            let _ = write!(out, "<code>{part}</code>");
        } else {
            for (j, p) in part.split("**").enumerate() {
                if j % 2 == 1 {
                    let _ = write!(out, "<b>{p}</b>");
                } else {
                    out.push_str(p);
                }
            }
        }
    }
    out
}

/// The markdown the legs write (paragraphs, `- ` lists, pipe tables, fenced code) as HTML.
pub fn markdown_to_html(md: &str) -> String {
    let mut out = String::new();
    let lines: Vec<&str> = md.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim_end();
        if line.starts_with("```") {
            let end = lines[i + 1..].iter().position(|l| l.starts_with("```")).map_or(lines.len(), |p| i + 1 + p);
            let _ = writeln!(out, "<pre>{}</pre>", escape(&lines[i + 1..end].join("\n")));
            i = end + 1;
        } else if line.starts_with('|') {
            let end = lines[i..].iter().position(|l| !l.starts_with('|')).map_or(lines.len(), |p| i + p);
            out.push_str("<table>\n");
            for (r, row) in lines[i..end].iter().enumerate() {
                let cells: Vec<&str> = row.trim().trim_matches('|').split('|').map(str::trim).collect();
                if cells.iter().all(|c| !c.is_empty() && c.chars().all(|ch| ch == '-' || ch == ':')) {
                    continue;
                }
                let tag = if r == 0 { "th" } else { "td" };
                out.push_str("<tr>");
                for c in cells {
                    let _ = write!(out, "<{tag}>{}</{tag}>", inline(c));
                }
                out.push_str("</tr>\n");
            }
            out.push_str("</table>\n");
            i = end;
        } else if line.starts_with("- ") {
            out.push_str("<ul>\n");
            while i < lines.len() && lines[i].starts_with("- ") {
                let _ = writeln!(out, "<li>{}</li>", inline(&lines[i][2..]));
                i += 1;
            }
            out.push_str("</ul>\n");
        } else if let Some(h) = line.strip_prefix("## ") {
            let _ = writeln!(out, "<h3>{}</h3>", inline(h));
            i += 1;
        } else if line.trim().is_empty() {
            i += 1;
        } else {
            let end = lines[i..].iter().position(|l| l.trim().is_empty() || l.starts_with('|') || l.starts_with("- ") || l.starts_with("```")).map_or(lines.len(), |p| i + p);
            let _ = writeln!(out, "<p>{}</p>", inline(&lines[i..end].join(" ")));
            i = end.max(i + 1);
        }
    }
    out
}

/// An SVG file as an inline element: without its XML declaration, each plot marked for the page's check.
fn inline_svg(svg: &str, name: &str) -> String {
    let body = svg.trim_start();
    let body = if body.starts_with("<?xml") { body.split_once("?>").map_or(body, |(_, rest)| rest.trim_start()) } else { body };
    body.replacen("<svg", &format!("<svg class=\"plot\" data-name=\"{}\"", escape(name)), 1)
}

const STYLE: &str = "body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}\
table{border-collapse:collapse;margin:1em 0;font-size:14px}td,th{border:1px solid #bbb;padding:3px 8px;text-align:right}\
th{background:#eee}td:first-child,th:first-child{text-align:left}pre{background:#f4f4f4;padding:8px;overflow-x:auto}\
svg.plot{display:block;margin:1em 0;max-width:100%;height:auto}h2{border-bottom:1px solid #ccc;margin-top:2em}";

/// After load, the page checks that every plot has a drawn size and says so at its end (`#plots-rendered`:
/// "N of M plots rendered"), for a reader and for the headless-browser test.
const CHECK: &str = "<script>window.addEventListener('load',function(){var p=document.querySelectorAll('svg.plot'),n=0;\
p.forEach(function(s){var b=s.getBoundingClientRect();var k=s.querySelectorAll('text,path,polyline,line,rect,circle').length;\
if(b.width>0&&b.height>0&&k>0){n++;s.setAttribute('data-rendered','1');}});\
var e=document.getElementById('plots-rendered');e.textContent=n+' of '+p.length+' plots rendered';e.setAttribute('data-ok',n==p.length?'1':'0');});</script>";

pub fn html(title: &str, legs: &[Leg]) -> String {
    let mut out = format!("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{}</title><style>{STYLE}</style></head><body>\n", escape(title));
    let _ = writeln!(out, "<h1>{}</h1>\n<p>{} legs. Machines and builds they ran on:</p>\n<ul>", escape(title), legs.len());
    for m in machines(legs) {
        let _ = writeln!(out, "<li>{}</li>", escape(&m));
    }
    out.push_str("</ul>\n");
    for leg in legs {
        let _ = writeln!(out, "<h2>{} <small>({})</small></h2>\n<pre>{}</pre>", escape(&leg.kind), escape(&leg.name), escape(&leg.command));
        out.push_str(&markdown_to_html(&leg.table));
        for (f, svg) in &leg.plots {
            out.push_str(&inline_svg(svg, &format!("{}/{f}", leg.name)));
            out.push('\n');
        }
    }
    let _ = write!(out, "<p id=\"plots-rendered\">plots not checked (scripts off)</p>\n{CHECK}\n</body></html>\n");
    out
}

/// Writes `report.md` (and `report.html` with `html`) into `dir`; returns their paths.
pub fn write(dir: &Path, title: &str, with_html: bool) -> Result<Vec<PathBuf>, LabError> {
    let legs = find_legs(dir)?;
    if legs.is_empty() {
        return Err(LabError::Request(format!("no lab output in {} (a leg's directory holds command.txt and table.md)", dir.display())));
    }
    let mut written = vec![dir.join("report.md")];
    std::fs::write(&written[0], markdown(title, &legs))?;
    if with_html {
        written.push(dir.join("report.html"));
        std::fs::write(&written[1], html(title, &legs))?;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_lists_and_code_become_html() {
        let md = "Intro line\nsecond line\n\n| a | b |\n|---|---|\n| 1 `x` | **2** |\n\n- one\n- two <3\n\n```\ncmd --flag\n```\n";
        let h = markdown_to_html(md);
        assert!(h.contains("<p>Intro line second line</p>"));
        assert!(h.contains("<tr><th>a</th><th>b</th></tr>"));
        assert!(h.contains("<tr><td>1 <code>x</code></td><td><b>2</b></td></tr>"));
        assert!(!h.contains("---"));
        assert!(h.contains("<li>two &lt;3</li>"));
        assert!(h.contains("<pre>cmd --flag</pre>"));
    }

    #[test]
    fn an_svg_file_becomes_a_marked_inline_element() {
        let svg = "<?xml version=\"1.0\"?>\n<svg width=\"10\" height=\"10\"><rect/></svg>";
        assert_eq!(inline_svg(svg, "a/b.svg"), "<svg class=\"plot\" data-name=\"a/b.svg\" width=\"10\" height=\"10\"><rect/></svg>");
    }
}
