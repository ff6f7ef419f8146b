//! The shape of the code, checked: layers point down only (folder by folder: cli → launch,
//! commands → train → run → plan → model, dist, data, telemetry → config, sys, tensor_io), and
//! no source files import each other through a cycle. The arrows are read from the source as
//! text: every `crate::…`, `super::…` and `self::…` path (in `use` items, braces expanded, and
//! inline), and a `mod.rs` using its own children by name; `#[cfg(test)] mod tests` blocks and
//! comments are left out.
//!
//! A child's arrow to a `mod.rs` above it counts in the cycle check only when it uses
//! something that `mod.rs` defines itself (see `definitions`): using what the parent merely
//! re-exports (`pub use child::X`, `pub mod child`) goes to the file that defines it, not to
//! the parent. A glob (`use super::*`) counts when the child's code names any of the parent's
//! own definitions. A parent's own types and functions that its children need live in a leaf
//! file of their own (`plan/setting.rs`), re-exported by the parent.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each top-level module's level: an arrow must go to a higher number.
fn level(top: &str) -> usize {
    match top {
        "cli" | "main" | "lib" => 0,
        "launch" | "commands" => 1,
        "train" => 2,
        "run" => 3,
        "plan" => 4,
        "model" | "dist" | "data" | "telemetry" => 5,
        "config" | "sys" | "tensor_io" => 6,
        other => panic!("src/{other}: a top-level module without a layer; add it to tests/layers.rs and docs/layout.md"),
    }
}

/// A source file as a module path (`["train", "checkpoint"]` for train/checkpoint/mod.rs).
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .with_extension("")
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// A file without its trailing inline unit tests. An inline `mod tests {` only: a `mod tests;`
/// declaration is followed by the file's code (round 5, finding 30: 312 lines of launch/mod.rs
/// were never read).
fn without_tests(text: &str) -> &str {
    match text.find("#[cfg(test)]\nmod tests {") {
        Some(at) => &text[..at],
        None => text,
    }
}

/// The code of a file that counts: without comments and without its trailing unit tests.
fn code(text: &str) -> String {
    without_tests(text)
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The names a file's code defines at the top level (not indented): each `fn`, `struct`,
/// `enum`, `union`, `const`, `static`, `type`, `trait`, inline `mod name {` and
/// `macro_rules! name`, whatever its visibility. A `use` (a re-export) defines nothing.
fn definitions(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in code.lines() {
        if line.starts_with([' ', '\t', '}', '#']) {
            continue;
        }
        let mut words = line.split_whitespace().peekable();
        while words.peek().is_some_and(|w| {
            w.starts_with("pub") || ["async", "unsafe", "extern", "\"C\"", "mut"].contains(w)
        }) {
            words.next();
        }
        let (Some(kind), Some(name)) = (words.next(), words.next()) else {
            continue;
        };
        // `const fn f`, `static mut X`: the name is one word further on.
        let name = match (kind, name) {
            ("const", "fn" | "unsafe" | "async") | ("static", "mut") => words
                .find(|w| !["fn", "unsafe", "async"].contains(w))
                .unwrap_or(""),
            _ => name,
        };
        let name: String = name
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let defines = match kind {
            "fn" | "struct" | "enum" | "union" | "const" | "static" | "type" | "trait" => true,
            "mod" => line.trim_end().ends_with('{'),
            "macro_rules!" => true,
            _ => false,
        };
        if defines && !name.is_empty() && name != "_" {
            out.insert(name);
        }
    }
    out
}

/// `a::b::{c, d::{e, f}}` → `a::b::c`, `a::b::d::e`, `a::b::d::f` (each as segments).
fn expand(path: &str) -> Vec<Vec<String>> {
    let Some(open) = path.find('{') else {
        let path = path.split(['#', ' ']).next().unwrap_or(path);
        return vec![path
            .split("::")
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()];
    };
    let head: Vec<String> = path[..open]
        .split("::")
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    let inner = &path[open + 1..path.rfind('}').unwrap_or(path.len())];
    let (mut items, mut depth, mut cur) = (Vec::new(), 0, String::new());
    for ch in inner.chars() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    items.push(cur);
    items
        .iter()
        .filter(|i| !i.trim().is_empty())
        .flat_map(|i| expand(i.trim()))
        .map(|tail| head.iter().cloned().chain(tail).collect())
        .collect()
}

/// The paths a file names that start at `crate`, `super` or `self`.
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let squashed: String = code.split_whitespace().collect::<Vec<_>>().join(" ");
    for item in squashed.split("use ").skip(1) {
        let Some(end) = item.find(';') else { continue };
        // `x as y` keeps `x`: the renaming is marked before the spaces go.
        let item = item[..end].replace(" as ", "#").replace(' ', "");
        if ["crate::", "super::", "self::"]
            .iter()
            .any(|p| item.starts_with(p))
        {
            out.extend(expand(&item));
        }
    }
    let text = code;
    for start in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(at) = text[from..].find(start) {
            let at = from + at;
            from = at + start.len();
            let before = text[..at].chars().last();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let path: String = text[at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            out.push(
                path.split("::")
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect(),
            );
        }
    }
    out
}

struct Tree {
    /// Module path → file (relative to src/).
    files: BTreeMap<Vec<String>, PathBuf>,
    /// File → the files it uses.
    arrows: BTreeMap<PathBuf, BTreeSet<PathBuf>>,
    /// The arrows (child, ancestor `mod.rs`) by which a child uses something the ancestor
    /// defines itself, not only re-exports, with the names of those things.
    own: BTreeMap<(PathBuf, PathBuf), BTreeSet<String>>,
}

/// The identifiers a piece of code names.
fn words(code: &str) -> BTreeSet<&str> {
    code.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .collect()
}

fn tree() -> Tree {
    let src = common::root().join("src");
    let rels = common::rust_files(&src);
    let files: BTreeMap<Vec<String>, PathBuf> =
        rels.iter().map(|r| (module_of(r), r.clone())).collect();
    let codes: BTreeMap<&PathBuf, String> = rels
        .iter()
        .map(|r| (r, code(&std::fs::read_to_string(src.join(r)).unwrap())))
        .collect();
    let defined: BTreeMap<&PathBuf, BTreeSet<String>> =
        codes.iter().map(|(r, c)| (*r, definitions(c))).collect();
    // The file of the longest prefix of `path` that is a module, and that prefix's length.
    let resolve = |path: &[String]| {
        (1..=path.len())
            .rev()
            .find_map(|n| files.get(&path[..n]).map(|f| (f.clone(), n)))
    };
    let mut arrows: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    let mut own: BTreeMap<(PathBuf, PathBuf), BTreeSet<String>> = BTreeMap::new();
    for rel in &rels {
        let code = &codes[rel];
        let me = module_of(rel);
        let is_mod = matches!(
            rel.file_name().and_then(|n| n.to_str()),
            Some("mod.rs" | "lib.rs" | "main.rs")
        );
        let mut targets = Vec::new();
        for p in paths(code) {
            let (base, rest): (Vec<String>, &[String]) = match p.first().map(String::as_str) {
                Some("crate") => (Vec::new(), &p[1..]),
                Some("self") => (me.clone(), &p[1..]),
                Some("super") => {
                    let ups = p.iter().take_while(|s| *s == "super").count();
                    (me[..me.len().saturating_sub(ups)].to_vec(), &p[ups..])
                }
                _ => continue,
            };
            let full: Vec<String> = base.into_iter().chain(rest.iter().cloned()).collect();
            let Some((to, n)) = resolve(&full) else {
                continue;
            };
            if is_ancestor_mod(rel, &to) {
                let theirs = &defined[&to];
                let used: Vec<String> = match full.get(n).map(String::as_str) {
                    Some("*") => words(code)
                        .into_iter()
                        .filter(|w| theirs.contains(*w))
                        .map(String::from)
                        .collect(),
                    Some(item) if theirs.contains(item) => vec![item.to_string()],
                    _ => Vec::new(),
                };
                if !used.is_empty() && &to != rel {
                    own.entry((rel.clone(), to.clone()))
                        .or_default()
                        .extend(used);
                }
            }
            targets.push(to);
        }
        // A mod.rs that uses its children by name (`pub use writer::Writer;`).
        if is_mod {
            for line in code.lines() {
                let line = line.trim_start().trim_start_matches("pub ");
                if let Some(child) = line.strip_prefix("use ").and_then(|l| l.split("::").next()) {
                    let mut path = me.clone();
                    path.push(child.to_string());
                    targets.extend(files.get(&path).cloned());
                }
            }
        }
        let set = arrows.entry(rel.clone()).or_default();
        set.extend(targets.into_iter().filter(|t| t != rel));
    }
    Tree { files, arrows, own }
}

/// The top-level module a file is in.
fn top(rel: &Path) -> String {
    module_of(rel)
        .first()
        .cloned()
        .unwrap_or_else(|| "lib".into())
}

/// `parent` is a `mod.rs` (or lib.rs) whose folder holds `child`.
fn is_ancestor_mod(child: &Path, parent: &Path) -> bool {
    let name = parent.file_name().and_then(|n| n.to_str());
    matches!(name, Some("mod.rs" | "lib.rs"))
        && child.starts_with(parent.parent().unwrap_or(Path::new("")))
}

#[test]
fn layers_point_down_only() {
    let t = tree();
    assert!(t.files.len() > 100, "read {} files", t.files.len());
    let mut up = Vec::new();
    for (from, tos) in &t.arrows {
        for to in tos {
            let (a, b) = (top(from), top(to));
            if a != b && level(&b) <= level(&a) {
                up.push(format!(
                    "src/{} uses src/{} ({a} → {b})",
                    from.display(),
                    to.display()
                ));
            }
        }
    }
    assert!(
        up.is_empty(),
        "arrows that do not point down:\n{}",
        up.join("\n")
    );
    // The launcher supervises processes and never imports the trainer.
    assert!(t
        .arrows
        .iter()
        .all(|(from, tos)| top(from) != "launch" || tos.iter().all(|to| top(to) != "train")));
}

#[test]
fn no_source_files_import_each_other_in_a_cycle() {
    let t = tree();
    // An arrow from a child to a mod.rs above it counts when the child uses what that mod.rs
    // defines itself; using its re-exports does not.
    let graph: BTreeMap<&PathBuf, Vec<&PathBuf>> = t
        .arrows
        .iter()
        .map(|(f, tos)| {
            let counts = |to: &&PathBuf| {
                !is_ancestor_mod(f, to) || t.own.contains_key(&(f.clone(), (*to).clone()))
            };
            (f, tos.iter().filter(counts).collect())
        })
        .collect();
    // Tarjan's strongly connected components.
    struct State<'a> {
        graph: &'a BTreeMap<&'a PathBuf, Vec<&'a PathBuf>>,
        index: BTreeMap<&'a PathBuf, usize>,
        low: BTreeMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on: BTreeSet<&'a PathBuf>,
        cycles: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a PathBuf) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on.insert(v);
        for &w in s.graph.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                visit(s, w);
                let l = s.low[w].min(s.low[v]);
                s.low.insert(v, l);
            } else if s.on.contains(w) {
                let l = s.index[w].min(s.low[v]);
                s.low.insert(v, l);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on.remove(w);
                comp.push(format!("src/{}", w.display()));
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.cycles.push(comp);
            }
        }
    }
    let mut s = State {
        graph: &graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        cycles: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    let shown: Vec<String> = s.cycles.iter().map(|c| c.join(" ⇄ ")).collect();
    let parents: Vec<String> = t
        .own
        .iter()
        .filter(|((_, to), _)| {
            s.cycles
                .iter()
                .flatten()
                .any(|f| *f == format!("src/{}", to.display()))
        })
        .map(|((from, to), used)| {
            format!(
                "src/{} uses {used:?} from src/{}",
                from.display(),
                to.display()
            )
        })
        .collect();
    assert!(
        shown.is_empty(),
        "files that import each other in a cycle:\n{}\n(a parent's own items that its \
         children use belong in a leaf file the parent re-exports:\n{})",
        shown.join("\n"),
        parents.join("\n")
    );
}

/// The longest function a source file may hold, in lines (signature to closing brace): a
/// function longer than a screen or two is split into named steps (round 5, finding 26:
/// `plan::report::compute_text` had grown to 159).
const LONGEST_FUNCTION: usize = 120;

/// The functions with a body in `text` (rustfmt's layout: the body closes with `}` at the
/// signature's indentation), as (name, first line, lines).
fn functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let body = line.trim_start();
        let indent = &line[..line.len() - body.len()];
        let mut words = body.split_whitespace().peekable();
        // Qualifiers before `fn`: pub, pub(crate), const, async, unsafe, extern "C".
        while words.peek().is_some_and(|w| {
            w.starts_with("pub") || ["const", "async", "unsafe", "extern", "\"C\""].contains(w)
        }) {
            words.next();
        }
        if words.next() != Some("fn") {
            continue;
        }
        let name: String = words
            .next()
            .unwrap_or("")
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // A declaration (a trait's or an extern block's) ends with `;` before any `{`.
        let opens = lines[n..]
            .iter()
            .map(|l| l.trim_end())
            .find(|l| l.ends_with('{') || l.ends_with(';'));
        if !opens.is_some_and(|l| l.ends_with('{')) {
            continue;
        }
        let closing = format!("{indent}}}");
        if let Some(len) = lines[n..].iter().position(|l| *l == closing) {
            out.push((name, n + 1, len + 1));
        }
    }
    out
}

#[test]
fn no_function_is_longer_than_two_screens() {
    let src = common::root().join("src");
    let mut long = Vec::new();
    let mut seen = 0;
    for rel in common::rust_files(&src) {
        let text = std::fs::read_to_string(src.join(&rel)).unwrap();
        for (name, line, len) in functions(without_tests(&text)) {
            seen += 1;
            if len > LONGEST_FUNCTION {
                long.push(format!("src/{}:{line} {name}: {len} lines", rel.display()));
            }
        }
    }
    assert!(seen > 1000, "read {seen} functions");
    assert!(
        long.is_empty(),
        "functions over {LONGEST_FUNCTION} lines (split them into named steps):\n{}",
        long.join("\n")
    );
    // The reader measures what it must.
    let sample = "pub(crate) fn a() {\n    x();\n}\n\nfn b();\n    unsafe extern \"C\" fn c(\n        y: i32,\n    ) -> i32 {\n        y\n    }\n";
    assert_eq!(
        functions(sample),
        [("a".to_string(), 1, 3), ("c".to_string(), 6, 5)]
    );
}

/// The reader finds what it must: the arrows of a file that uses `super::`, braces and inline
/// paths (so the two checks above cannot pass by reading nothing).
#[test]
fn the_arrows_are_read() {
    let t = tree();
    let of = |f: &str| t.arrows[&PathBuf::from(f)].clone();
    let run = of("launch/run.rs");
    for want in ["run/mod.rs", "plan/start.rs", "config/mod.rs"] {
        assert!(
            run.contains(&PathBuf::from(want)),
            "launch/run.rs → {want}: {run:?}"
        );
    }
    let writer = of("train/checkpoint/writer.rs");
    assert!(
        writer.contains(&PathBuf::from("run/checkpoints/mod.rs")),
        "{writer:?}"
    );
    // A child using what its parent defines counts (config/tests.rs: `super::resolve`); one
    // using what the parent only re-exports (config/validate.rs: `super::Config`, from
    // config/types.rs) is an arrow that does not.
    let own = |from: &str, to: &str| t.own.get(&(PathBuf::from(from), PathBuf::from(to)));
    assert!(
        own("config/tests.rs", "config/mod.rs").is_some_and(|used| used.contains("resolve")),
        "{:?}",
        t.own
    );
    assert!(of("config/validate.rs").contains(&PathBuf::from("config/mod.rs")));
    assert_eq!(own("config/validate.rs", "config/mod.rs"), None);
    let defined = definitions("pub(crate) const fn a() {}\nstruct B;\n    fn c() {}\npub use d::E;\nmacro_rules! f {\nmod g {\nmod h;\n");
    assert_eq!(
        defined.into_iter().collect::<Vec<_>>(),
        ["B", "a", "f", "g"]
    );
    // A `mod tests;` declaration does not end the code read.
    assert!(
        code("#[cfg(test)]\nmod tests;\n\nuse crate::train::Trainer;\n").contains("crate::train")
    );
    let expanded: Vec<String> = expand("crate::a::{b,c::{d,e#f}}")
        .iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(
        expanded,
        ["crate::a::b", "crate::a::c::d", "crate::a::c::e"]
    );
}
