//! Config resolution: schema defaults < preset < `--config FILE.json` < `--set key=value` <
//! named flags. Every layer is checked against `schema::KEYS` before it is merged, so an error
//! names the layer (file, preset or flag) the bad key came from.

mod choices;
mod error;
mod mesh;
pub mod presets;
pub mod schema;
pub mod secrets;
mod types;
mod validate;

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

pub use choices::*;
pub use error::ConfigError;
pub use mesh::MeshShape;
pub use secrets::{Credentials, Secrets};
pub use types::*;
pub use validate::{
    check_backend_device, check_expert_parallel_model, check_pipeline_layers, check_ranks,
    check_tensor_parallel, check_trains, check_world, prefetch_units, tensor_parallel_splits,
    world_notes, MIN_SOURCE_SHARE, MLFLOW_EXPERIMENT_MAX, MLFLOW_RUN_NAME_MAX,
};

fn err<T>(msg: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError(msg.into()))
}

/// A command-line value that cannot work (`--gpus 0`): unless `ok`, the usage error `msg`,
/// which exits 2 as a bad config key does.
pub fn usage(ok: bool, msg: impl FnOnce() -> String) -> Result<(), ConfigError> {
    if ok {
        Ok(())
    } else {
        err(msg())
    }
}

/// Everything on the command line that shapes the config.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    pub preset: Option<String>,
    pub config_file: Option<PathBuf>,
    pub sets: Vec<String>,
    pub max_steps: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct Resolved {
    /// Without credentials: every copy of it that is written or sent is safe to keep.
    pub config: Config,
    pub preset: String,
    /// The credentials taken out of `config` (memory only).
    pub secrets: Secrets,
}

impl Resolved {
    /// A config that was resolved elsewhere (the launcher's worker spec), checked again.
    pub fn new(mut config: Config, preset: String) -> Result<Resolved, ConfigError> {
        let secrets = Secrets::take(&mut config.logging.mlflow.tracking_uri);
        validate::check(&config)?;
        Ok(Resolved {
            config,
            preset,
            secrets,
        })
    }

    pub fn to_json(&self) -> Value {
        serde_json::to_value(&self.config).expect("config serializes")
    }

    /// The resolved config as written to the run directory's config.json.
    pub fn to_json_text(&self) -> String {
        serde_json::to_string_pretty(&self.to_json()).expect("config serializes")
    }

    /// The run directory: `logging.dir/<logging.run_name>` (the preset's name by default).
    pub fn run_dir(&self) -> PathBuf {
        let c = &self.config.logging;
        Path::new(&c.dir).join(c.run_name.as_deref().unwrap_or(&self.preset))
    }
}

/// Refuses a `--config` file that is the run directory's config.json when writing the resolved
/// config there would change it: that file would be replaced by the resolved config with every
/// `--set` baked in, and the next run would inherit them without a word. A config.json that
/// lockstep wrote, used again unchanged, passes.
fn check_config_clash(file: &Path, resolved: &Resolved) -> Result<(), ConfigError> {
    let target = resolved.run_dir().join("config.json");
    let same = match (std::fs::metadata(file), std::fs::metadata(&target)) {
        (Ok(a), Ok(b)) => {
            use std::os::unix::fs::MetadataExt;
            (a.dev(), a.ino()) == (b.dev(), b.ino())
        }
        _ => false,
    };
    if !same || std::fs::read_to_string(file).ok() == Some(resolved.to_json_text()) {
        return Ok(());
    }
    let l = &resolved.config.logging;
    Err(ConfigError(format!(
        "--config {} is the run directory's config.json (logging.dir = {:?}, logging.run_name = \
         {:?}), where lockstep writes the resolved config of every run: your file would be \
         replaced, with the --set values baked in. Keep your config outside the run directory \
         (e.g. {}), or give the run another name with --set logging.run_name=NAME",
        file.display(),
        l.dir,
        l.run_name.as_deref().unwrap_or(&resolved.preset),
        Path::new(&l.dir)
            .join(format!(
                "{}.json",
                l.run_name.as_deref().unwrap_or(&resolved.preset)
            ))
            .display()
    )))
}

pub fn resolve(src: &Sources) -> Result<Resolved, ConfigError> {
    let preset = src
        .preset
        .clone()
        .unwrap_or_else(|| presets::DEFAULT.to_string());
    let mut merged = defaults();

    let preset_json = presets::get(&preset)?;
    let layer = parse_json(preset_json, &format!("preset {preset}"))?;
    merge(
        &mut merged,
        checked_layer(layer, &format!("preset {preset}"))?,
    );

    if let Some(file) = &src.config_file {
        let origin = file.display().to_string();
        let text = read_config_file(file)?;
        let layer = parse_json(&text, &origin)?;
        merge(&mut merged, checked_layer(layer, &origin)?);
    }

    for set in &src.sets {
        let (key, value) = parse_set(set)?;
        set_path(&mut merged, key, value);
    }
    if let Some(n) = src.max_steps {
        // The flag is checked as `--set training.max_steps=N` is (`--max-steps 0` was taken).
        let spec = known_key("training.max_steps", "--max-steps")?;
        let value = check_kind(spec, Value::from(n), &format!("--max-steps {n}"))?;
        set_path(&mut merged, spec.key, value);
    }

    let config: Config = serde_json::from_value(merged).map_err(|e| {
        ConfigError(format!(
            "internal: resolved config does not match its schema: {e}"
        ))
    })?;
    let resolved = Resolved::new(config, preset)?;
    if let Some(file) = &src.config_file {
        check_config_clash(file, &resolved)?;
    }
    Ok(resolved)
}

/// The file's text, without the UTF-8 byte-order mark some Windows editors put first (JSON
/// has none, and serde_json would call it "expected value at line 1 column 1").
fn read_config_file(file: &Path) -> Result<String, ConfigError> {
    let text = std::fs::read_to_string(file).map_err(|e| {
        ConfigError(format!(
            "--config {}: cannot read the file ({e}); check the path",
            file.display()
        ))
    })?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    })
}

fn parse_json(text: &str, origin: &str) -> Result<Value, ConfigError> {
    serde_json::from_str(text).map_err(|e| {
        ConfigError(format!(
            "{origin}: not valid JSON at line {}, column {}: {e}; fix the syntax (JSON allows no comments or trailing commas)",
            e.line(),
            e.column()
        ))
    })
}

/// Nested object of every key's schema default.
fn defaults() -> Value {
    let mut root = Value::Object(Map::new());
    for k in schema::KEYS {
        let v: Value = serde_json::from_str(k.default).expect("schema defaults are valid JSON");
        set_path(&mut root, k.key, v);
    }
    root
}

/// Checks every key of one layer (known, right type) and rewrites aliases to canonical keys.
fn checked_layer(layer: Value, origin: &str) -> Result<Value, ConfigError> {
    let Value::Object(sections) = layer else {
        return err(format!(
            "{origin}: the top level must be a JSON object with sections {}",
            schema::SECTIONS.join(", ")
        ));
    };
    let mut out = Value::Object(Map::new());
    for (section, body) in sections {
        let Value::Object(entries) = body else {
            let hint = match schema::suggest(&section) {
                Some(s) => format!(" (did you mean \"{s}\" inside a section?)"),
                None => String::new(),
            };
            return err(format!(
                "{origin}: \"{section}\" must be a section object {{...}}; sections are {}{hint}",
                schema::SECTIONS.join(", ")
            ));
        };
        if !schema::SECTIONS.contains(&section.as_str()) {
            return err(format!(
                "{origin}: unknown section \"{section}\"; known sections: {}{}",
                schema::SECTIONS.join(", "),
                suggestion_suffix(&section)
            ));
        }
        check_entries(&section, entries, &mut out, origin)?;
    }
    Ok(out)
}

/// The keys under `prefix` (a section, or a group inside one such as `logging.wandb`): each one
/// known and of the right kind, a group's object checked key by key.
fn check_entries(
    prefix: &str,
    entries: Map<String, Value>,
    out: &mut Value,
    origin: &str,
) -> Result<(), ConfigError> {
    for (leaf, value) in entries {
        let full = format!("{prefix}.{leaf}");
        let key = schema::canonical(&full);
        if schema::find(key).is_none() && schema::is_group(key) {
            let Value::Object(inner) = value else {
                return err(format!(
                    "{origin}: \"{key}\" must be an object {{...}} of its keys ({})",
                    schema::group_keys(key).join(", ")
                ));
            };
            check_entries(key, inner, out, origin)?;
            continue;
        }
        let spec = known_key(key, origin)?;
        let value = check_kind(spec, value, origin)?;
        set_path(out, spec.key, value);
    }
    Ok(())
}

fn known_key(key: &str, origin: &str) -> Result<&'static schema::KeySpec, ConfigError> {
    schema::find(key).ok_or_else(|| {
        ConfigError(format!(
            "{origin}: unknown config key \"{key}\"{}; `lockstep config --keys` lists all keys",
            suggestion_suffix(key)
        ))
    })
}

fn suggestion_suffix(key: &str) -> String {
    schema::suggest(key).map_or_else(String::new, |s| format!(" (did you mean \"{s}\"?)"))
}

/// `value` checked against `spec`'s kind, as the typed config reads it (`Kind::normalized`).
fn check_kind(spec: &schema::KeySpec, value: Value, origin: &str) -> Result<Value, ConfigError> {
    match spec.kind {
        _ if spec.kind.accepts(&value) => Ok(spec.kind.normalized(value)),
        // A list of records: name the entry and field at fault rather than print the whole list.
        schema::Kind::Records(_) if value.is_array() => err(format!(
            "{origin}: {}{}",
            spec.key,
            spec.kind.problem(&value).unwrap_or_default()
        )),
        // `--set key=value` already names the key and the value.
        _ if origin.starts_with("--") => {
            err(format!("{origin}: expected {}", spec.kind.describe()))
        }
        _ => err(format!(
            "{origin}: {} = {value} is not allowed; expected {}",
            spec.key,
            spec.kind.describe()
        )),
    }
}

/// `--set section.key=value`: the value is JSON where it parses as such, else a plain string,
/// so `--set data.path=corpus.txt` needs no quotes.
fn parse_set(set: &str) -> Result<(&'static str, Value), ConfigError> {
    let origin = format!("--set {set}");
    let Some((key, raw)) = set.split_once('=') else {
        return err(format!(
            "{origin}: expected section.key=value, e.g. --set training.learning_rate=3e-4"
        ));
    };
    let key = schema::canonical(key.trim());
    if schema::find(key).is_none() && schema::is_group(key) {
        return err(format!(
            "{origin}: {key} is a group of keys ({}); set them one at a time, e.g. --set {key}.{}=…",
            schema::group_keys(key).join(", "),
            schema::group_keys(key)[0]
        ));
    }
    let spec = known_key(key, &origin)?;
    let raw = raw.trim();
    let value = match spec.kind {
        schema::Kind::Str | schema::Kind::Choice(_) => Value::String(unquote(raw)),
        schema::Kind::OptStr if raw == "null" => Value::Null,
        schema::Kind::OptStr => Value::String(unquote(raw)),
        schema::Kind::StrList => serde_json::from_str(raw).unwrap_or_else(|_| {
            raw.split(',')
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .map(|t| Value::String(t.to_string()))
                .collect()
        }),
        _ => serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string())),
    };
    Ok((spec.key, check_kind(spec, value, &origin)?))
}

fn unquote(raw: &str) -> String {
    serde_json::from_str::<String>(raw).unwrap_or_else(|_| raw.to_string())
}

/// Puts `value` at a dotted key (`logging.wandb.project`), making the objects on the way.
fn set_path(root: &mut Value, key: &str, value: Value) {
    let (groups, leaf) = key.rsplit_once('.').expect("keys are section.key");
    let mut obj = root.as_object_mut().expect("root is an object");
    for group in groups.split('.') {
        obj = obj
            .entry(group)
            .or_insert_with(|| Value::Object(Map::new()))
            .as_object_mut()
            .expect("sections and groups are objects");
    }
    obj.insert(leaf.to_string(), value);
}

/// Deep merge: objects merge key by key, anything else replaces.
fn merge(base: &mut Value, overlay: Value) {
    match (base, overlay) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (slot, v) => *slot = v,
    }
}

#[cfg(test)]
mod tests;
