//! Task files: each line an item of either form (`query`/`choices`/`gold`, or HellaSwag's
//! `ctx`/`endings`/`label`), checked field by field; a problem is a [`ConfigError`] naming the
//! file, the line and the field.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::task::{Gold, Item, Task};
use crate::config::ConfigError;
use crate::data::sources::{json_type, not_utf8};

/// The tasks `specs` name, in order: each a `.jsonl` file, or a directory standing for the
/// `.jsonl` files in it (by name). `what` names the setting in messages (`--task`,
/// `training.eval_tasks`); `limit` keeps the first N items of each task.
pub fn load_tasks(
    specs: &[impl AsRef<Path>],
    what: &str,
    limit: Option<usize>,
) -> anyhow::Result<Vec<Task>> {
    let mut tasks: Vec<Task> = Vec::new();
    for spec in specs {
        for path in task_files(spec.as_ref(), what)? {
            let mut task = read_task(&path)?;
            if let Some(n) = limit {
                task.items.truncate(n);
            }
            if let Some(same) = tasks.iter().find(|t| t.name == task.name) {
                return Err(ConfigError(format!(
                    "{what}: {} and {} would both be the task `{}` (a task is named by its \
                     file's stem); rename one of them",
                    same.path.display(),
                    path.display(),
                    task.name
                ))
                .into());
            }
            tasks.push(task);
        }
    }
    Ok(tasks)
}

/// The files `spec` stands for: itself, or a directory's `.jsonl` files in name order.
fn task_files(spec: &Path, what: &str) -> Result<Vec<PathBuf>, ConfigError> {
    let p = spec.display();
    if spec.is_file() {
        return Ok(vec![spec.to_path_buf()]);
    }
    if !spec.is_dir() {
        return Err(ConfigError(format!(
            "{what} {p}: no such file or directory; pass a task .jsonl file (or a directory of \
             them; docs/evaluation.md shows how to write one)"
        )));
    }
    let entries = std::fs::read_dir(spec)
        .map_err(|e| ConfigError(format!("{what} {p}: cannot list the directory ({e})")))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|f| f.is_file() && f.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ConfigError(format!(
            "{what} {p}: the directory holds no .jsonl task files"
        )));
    }
    Ok(files)
}

/// Reads and checks one task file.
pub fn read_task(path: &Path) -> Result<Task, ConfigError> {
    let p = path.display();
    let bytes = std::fs::read(path).map_err(|e| ConfigError(format!("{p}: cannot read ({e})")))?;
    let mut items = Vec::new();
    let mut start = 0usize;
    for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let at = format!("{p}:{}", i + 1);
        let line_start = start;
        start += raw.len() + 1;
        let text = std::str::from_utf8(raw).map_err(|e| {
            let head = (line_start == 0).then_some(raw);
            let offset = (line_start + e.valid_up_to()) as u64;
            ConfigError(format!(
                "{:#}; task files are UTF-8 JSON lines",
                not_utf8(&at, offset, head)
            ))
        })?;
        let text = match i {
            0 => text.strip_prefix('\u{feff}').unwrap_or(text),
            _ => text,
        };
        if text.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(text).map_err(|e| {
            ConfigError(format!(
                "{at}: not valid JSON ({e}); a task file holds one JSON object per line \
                 (docs/evaluation.md)"
            ))
        })?;
        let Value::Object(obj) = value else {
            return Err(ConfigError(format!(
                "{at}: expected a JSON object (an item: query, choices, gold; or HellaSwag's ctx, \
                 endings, label), found {}",
                a_type(&value)
            )));
        };
        items.push(parse_item(&obj, &at, i + 1)?);
    }
    if items.is_empty() {
        return Err(ConfigError(format!(
            "{p}: holds no items; a task file holds one JSON object per line (docs/evaluation.md)"
        )));
    }
    Ok(Task {
        name: task_name(path),
        path: path.to_path_buf(),
        items,
    })
}

/// The task name of `path`: its stem, other characters than letters, digits, `_`, `-`, `.`
/// made `_`.
fn task_name(path: &Path) -> String {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned());
    stem.unwrap_or_default()
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '_' | '-' | '.' => c,
            _ => '_',
        })
        .collect()
}

/// The fields of one of the two forms: (context, choices, gold).
struct Form {
    context: &'static str,
    choices: &'static str,
    gold: &'static str,
}

const GENERAL: Form = Form {
    context: "query",
    choices: "choices",
    gold: "gold",
};

const HELLASWAG: Form = Form {
    context: "ctx",
    choices: "endings",
    gold: "label",
};

/// One line's item (`at` = `FILE:LINE`).
fn parse_item(obj: &Map<String, Value>, at: &str, line: usize) -> Result<Item, ConfigError> {
    let has = |f: &Form| {
        [f.context, f.choices, f.gold]
            .iter()
            .any(|k| obj.contains_key(*k))
    };
    let form = if has(&GENERAL) {
        &GENERAL
    } else if has(&HELLASWAG) {
        &HELLASWAG
    } else {
        let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        return Err(ConfigError(format!(
            "{at}: an item needs \"query\", \"choices\" and \"gold\" (or HellaSwag's \"ctx\", \
             \"endings\" and \"label\"); this line has {}",
            if keys.is_empty() {
                "no keys".to_string()
            } else {
                format!("only {}", keys.join(", "))
            }
        )));
    };
    let field = |name: &str| {
        obj.get(name).ok_or_else(|| {
            ConfigError(format!(
                "{at}: has no \"{name}\"; an item of this form needs \"{}\", \"{}\" and \"{}\"",
                form.context, form.choices, form.gold
            ))
        })
    };
    let wrong = |name: &str, v: &Value, want: &str| wrong_type(at, name, v, want);
    let context = match field(form.context)? {
        Value::String(s) => s.clone(),
        v => return Err(wrong(form.context, v, "a string")),
    };
    let list = field(form.choices)?;
    let Value::Array(values) = list else {
        return Err(wrong(form.choices, list, "a list of strings"));
    };
    if values.is_empty() {
        return Err(ConfigError(format!(
            "{at}: \"{}\" is an empty list; an item needs at least one choice",
            form.choices
        )));
    }
    let mut choices = Vec::with_capacity(values.len());
    for (c, v) in values.iter().enumerate() {
        match v {
            Value::String(s) if s.is_empty() => {
                return Err(ConfigError(format!(
                    "{at}: \"{}\"[{c}] is an empty string; acc_norm divides a choice's \
                     log-likelihood by its length, so every choice needs text",
                    form.choices
                )))
            }
            Value::String(s) => choices.push(s.clone()),
            v => return Err(wrong(&format!("{}[{c}]", form.choices), v, "a string")),
        }
    }
    let gold = gold_of(field(form.gold)?, form, &choices, at)?;
    Ok(Item {
        line,
        context,
        choices,
        gold,
    })
}

/// The right choice(s) from the gold field `v`: an index (HellaSwag's label may be a string of
/// digits, as its Hugging Face release has it), a list of indices (general form), or the text
/// of a choice (general form).
fn gold_of(v: &Value, form: &Form, choices: &[String], at: &str) -> Result<Gold, ConfigError> {
    let name = form.gold;
    let n = choices.len();
    let index = |g: u64| {
        if (g as usize) < n {
            Ok(g as usize)
        } else {
            Err(ConfigError(format!(
                "{at}: \"{name}\" = {g} is out of range: the item has {n} choice{} (indices \
                 0..{})",
                if n == 1 { "" } else { "s" },
                n - 1
            )))
        }
    };
    let hellaswag = std::ptr::eq(form, &HELLASWAG);
    let want = if hellaswag {
        "a choice's index (an integer, or a string of digits)"
    } else {
        "a choice's index, a list of indices, or the text of a choice"
    };
    let bad = || wrong_type(at, name, v, want);
    match v {
        Value::Number(x) => x.as_u64().ok_or_else(bad).and_then(index).map(Gold::One),
        Value::String(s) if hellaswag => match s.parse::<u64>() {
            Ok(g) if s.bytes().all(|b| b.is_ascii_digit()) => index(g).map(Gold::One),
            _ => Err(ConfigError(format!(
                "{at}: \"{name}\" = \"{s}\" is not a choice's index; HellaSwag's test split has \
                 no labels (\"\"): evaluate its validation split"
            ))),
        },
        Value::String(s) => match choices.iter().position(|c| c == s) {
            Some(i) => Ok(Gold::One(i)),
            None => Err(ConfigError(format!(
                "{at}: \"{name}\" = \"{s}\" is none of the {n} choices; give the index of the \
                 right choice, or its exact text"
            ))),
        },
        Value::Array(list) if !hellaswag && !list.is_empty() => {
            let all: Result<Vec<usize>, _> = list
                .iter()
                .map(|g| g.as_u64().ok_or_else(bad).and_then(index))
                .collect();
            all.map(Gold::AnyOf)
        }
        _ => Err(bad()),
    }
}

/// `FILE:LINE: "field" is a number (3), expected a string`.
fn wrong_type(at: &str, name: &str, v: &Value, want: &str) -> ConfigError {
    ConfigError(format!(
        "{at}: \"{name}\" is {} ({}), expected {want}",
        a_type(v),
        shorten(v)
    ))
}

/// A JSON value's type with its article: "an array", "a string".
fn a_type(v: &Value) -> String {
    let t = json_type(v);
    match t.starts_with(['a', 'o']) {
        true => format!("an {t}"),
        false => format!("a {t}"),
    }
}

/// A JSON value for a message: at most 60 characters of it.
fn shorten(v: &Value) -> String {
    let text = v.to_string();
    match text.char_indices().nth(60) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}
