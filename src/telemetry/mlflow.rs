//! MLflow tracking through its REST API (the 2.0 endpoints under
//! `<tracking_uri>/api/2.0/mlflow/`), run by a [`Tracker`](super::tracker::Tracker) on its own
//! thread.
//!
//! [`MlflowSink::start`](Sink::start) finds or creates the experiment, then continues the run
//! named in the run file (`resume`) or creates one, keeping its id in that file; it logs the
//! resolved config as params (only the missing ones on a continued run: MLflow's params are
//! immutable, so a value changed since is recorded as a `lockstep.changed.<key>` tag). Metrics go
//! out in `runs/log-batch` requests; the run ends with the run's status.
//!
//! Non-finite values are sent as protobuf's JSON strings (`"NaN"`, `"Infinity"`,
//! `"-Infinity"`): MLflow 3.17 stores NaN as NaN and clamps the infinities to ±f64::MAX. (Bare
//! `NaN` tokens, which serde_json never writes, make MLflow 3.17 store a garbled batch and still
//! answer 200.)

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::tracker::{Record, RunStatus, Sink, SinkError};
use crate::config::secrets::{redacted, split_credentials};
use crate::config::{Credentials, Resolved};

/// MLflow's limits per `runs/log-batch` request and per value.
const METRICS_PER_BATCH: usize = 1000;
const PARAMS_PER_BATCH: usize = 100;
const TAGS_PER_BATCH: usize = 100;
const PARAM_VALUE_CHARS: usize = 6000;
const TAG_VALUE_CHARS: usize = 8000;
const KEY_CHARS: usize = 250;
/// Points asked for per `metrics/get-history` page.
const HISTORY_PAGE: usize = 10_000;
/// The series whose last step tells where a continued run stands.
const STEP_KEY: &str = "train/loss";
/// Where to point a user whose address is wrong.
const URI_HINT: &str = "check logging.mlflow.tracking_uri or MLFLOW_TRACKING_URI";

/// What [`MlflowSink`] logs to, and under which names.
#[derive(Debug, Clone)]
pub struct MlflowOptions {
    /// The tracking server: `http(s)://host:port[/prefix]` (a trailing `/` is tolerated).
    /// User information in it is taken as `credentials` and never stored or shown.
    pub tracking_uri: String,
    /// Basic auth taken out of the address (`http://user:password@host`), kept in memory.
    pub credentials: Option<Credentials>,
    /// The experiment's name; created when the server has none of that name.
    pub experiment: String,
    /// The run's name (`mlflow.runName`) when a new run is created.
    pub run_name: String,
    /// Where the run's id is kept (e.g. `<run dir>/mlflow.json`), for a resume to continue it.
    pub run_file: PathBuf,
    /// Continue the run named in `run_file` when it is there, was made at this `tracking_uri`
    /// in this experiment and still exists on the server; false: always a new run.
    pub resume: bool,
    /// The flattened resolved config, e.g. `("training.learning_rate", "0.0003")`.
    pub params: Vec<(String, String)>,
    /// Run tags, e.g. `("lockstep.version", "0.1.0")`.
    pub tags: Vec<(String, String)>,
}

impl MlflowOptions {
    /// MLflow's options: on with `logging.mlflow.tracking_uri` or MLFLOW_TRACKING_URI; the resolved
    /// config as params, what the run is as `lockstep.*` tags.
    pub fn new(
        resolved: &Resolved,
        run_dir: &Path,
        resume: bool,
        about: &Value,
    ) -> Result<Option<MlflowOptions>, String> {
        let m = &resolved.config.logging.mlflow;
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        // The config's address had its credentials taken out when it was resolved; the
        // variable's are taken out here. Neither is stored or sent but as the Authorization header.
        let (uri, credentials) = match (&m.tracking_uri, env("MLFLOW_TRACKING_URI")) {
            (Some(uri), _) => (uri.clone(), resolved.secrets.mlflow.clone()),
            (None, Some(uri)) if uri.starts_with("http://") || uri.starts_with("https://") => {
                split_credentials(&uri)
            }
            (None, Some(uri)) => {
                return Err(format!(
                    "MLFLOW_TRACKING_URI = {:?} is not an MLflow server's http(s) address; \
                     lockstep logs to a tracking server (start one with `mlflow server`) - set \
                     logging.mlflow.tracking_uri, or unset MLFLOW_TRACKING_URI",
                    redacted(&uri)
                ))
            }
            (None, None) => return Ok(None),
        };
        let tags = about
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| {
                let text = v.as_str().map_or_else(|| v.to_string(), str::to_string);
                (format!("lockstep.{k}"), text)
            })
            .collect();
        let experiment = m
            .experiment
            .clone()
            .or_else(|| env("MLFLOW_EXPERIMENT_NAME"))
            .unwrap_or_else(|| "lockstep".into());
        let most = crate::config::MLFLOW_EXPERIMENT_MAX;
        if experiment.chars().count() > most {
            return Err(format!(
                "MLFLOW_EXPERIMENT_NAME is {} characters long; MLflow keeps at most {most}: shorten \
                 it, or set logging.mlflow.experiment",
                experiment.chars().count()
            ));
        }
        Ok(Some(MlflowOptions {
            tracking_uri: uri,
            credentials,
            experiment,
            run_name: m
                .run_name
                .clone()
                .unwrap_or_else(|| super::run_name(run_dir)),
            run_file: run_dir.join("mlflow.json"),
            resume,
            params: super::flat_params(&resolved.to_json()),
            tags,
        }))
    }
}

/// An MLflow tracking client: the [`Sink`] a [`Tracker`](super::tracker::Tracker) runs for
/// MLflow.
pub struct MlflowSink {
    opts: MlflowOptions,
    /// `tracking_uri` without its trailing `/`.
    base: String,
    agent: ureq::Agent,
    /// The `Authorization` header's value, from the environment.
    auth: Option<String>,
    /// The run once started: a start after a failure continues it.
    run: Option<RunIds>,
}

/// The run file's contents.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RunIds {
    tracking_uri: String,
    experiment_id: String,
    run_id: String,
}

/// A failed call: the error for the tracker, and MLflow's `error_code` when it sent one.
struct Failure {
    code: Option<String>,
    error: SinkError,
}

impl Failure {
    fn is(&self, code: &str) -> bool {
        self.code.as_deref() == Some(code)
    }
}

impl From<Failure> for SinkError {
    fn from(f: Failure) -> SinkError {
        f.error
    }
}

impl MlflowSink {
    /// A client for `opts`; talks to nothing until [`Sink::start`]. Credentials come from
    /// MLFLOW_TRACKING_TOKEN (a bearer token), else the address's user information
    /// (`opts.credentials`), else MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (basic
    /// auth).
    pub fn new(opts: MlflowOptions) -> MlflowSink {
        let (bare, in_uri) = split_credentials(&opts.tracking_uri);
        let base = bare.trim_end_matches('/').to_string();
        let parsed = url::Url::parse(&base).ok();
        let host = parsed
            .as_ref()
            .and_then(|u| u.host_str())
            .unwrap_or("")
            .to_string();
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(5))
            // Bounded: a server that accepts connections and never answers costs a request
            // this long (on the tracker's thread, never training's).
            .timeout_read(Duration::from_secs(10))
            .timeout_write(Duration::from_secs(10))
            .redirects(0)
            .try_proxy_from_env(crate::sys::net::proxied(
                &host,
                &crate::sys::net::no_proxy(),
            ))
            .user_agent(&format!("lockstep/{}", env!("CARGO_PKG_VERSION")))
            .build();
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let basic = |user: &str, password: &str| {
            format!("Basic {}", base64(format!("{user}:{password}").as_bytes()))
        };
        let auth = match (
            var("MLFLOW_TRACKING_TOKEN"),
            opts.credentials.as_ref().or(in_uri.as_ref()),
            var("MLFLOW_TRACKING_USERNAME"),
            var("MLFLOW_TRACKING_PASSWORD"),
        ) {
            (Some(token), ..) => Some(format!("Bearer {token}")),
            (None, Some(c), ..) => Some(basic(&c.username, &c.password)),
            (None, None, Some(user), Some(password)) => Some(basic(&user, &password)),
            _ => None,
        };
        MlflowSink {
            opts,
            base,
            agent,
            auth,
            run: None,
        }
    }

    /// One request to `<tracking_uri>/api/2.0/mlflow/<path>` and its JSON answer. A GET sends
    /// `body`'s fields as the query. Every failure is mapped to a [`SinkError`] here.
    fn call(&self, method: &str, path: &str, body: Value) -> Result<Value, Failure> {
        let url = format!("{}/api/2.0/mlflow/{path}", self.base);
        let what = format!("{method} {path}");
        let mut req = self.agent.request(method, &url);
        if let Some(auth) = &self.auth {
            req = req.set("Authorization", auth);
        }
        let answer = if method == "GET" {
            for (k, v) in body.as_object().into_iter().flatten() {
                req = match v {
                    Value::String(s) => req.query(k, s),
                    v => req.query(k, &v.to_string()),
                };
            }
            req.call()
        } else {
            req.set("Content-Type", "application/json")
                .send_string(&body.to_string())
        };
        let fail = |code: Option<String>, error: SinkError| Failure { code, error };
        let at = &self.base;
        match answer {
            Ok(resp) if resp.status() >= 300 => {
                let to = resp.header("location").unwrap_or("elsewhere").to_string();
                Err(fail(
                    None,
                    SinkError::lasting(format!(
                        "MLflow at {at} redirects {what} to {to} (HTTP {}); set the server's own \
                         address: {URI_HINT}",
                        resp.status()
                    )),
                ))
            }
            Ok(resp) => serde_json::from_reader::<_, Value>(resp.into_reader()).map_err(|e| {
                let error = if e.is_io() {
                    SinkError::passing(format!(
                        "MLflow at {at}: reading the answer to {what} failed ({e})"
                    ))
                } else {
                    SinkError::lasting(format!(
                        "{at} answered {what} with something other than MLflow's JSON ({e}); is \
                         it an MLflow tracking server? {URI_HINT}"
                    ))
                };
                fail(None, error)
            }),
            Err(ureq::Error::Status(status, resp)) => Err(self.refused(status, resp, &what, path)),
            Err(ureq::Error::Transport(t)) => Err(fail(None, self.unreachable(&t, &what))),
        }
    }

    /// A request the server answered with an error status: the failure, with MLflow's error
    /// code when it gave one.
    fn refused(&self, status: u16, resp: ureq::Response, what: &str, path: &str) -> Failure {
        let at = &self.base;
        let text = resp.into_string().unwrap_or_default();
        let parsed = serde_json::from_str::<Value>(&text).ok();
        let field = |k: &str| {
            parsed
                .as_ref()
                .and_then(|v| v.get(k))
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        let code = field("error_code");
        let said = match (&code, field("message")) {
            (Some(c), Some(m)) => format!(": {c}: {}", first_line(&m)),
            (Some(c), None) => format!(": {c}"),
            (None, Some(m)) => format!(": {}", first_line(&m)),
            (None, None) => String::new(),
        };
        let error = match status {
            401 | 403 => SinkError::lasting(format!(
                "MLflow at {at} refused {what} (HTTP {status}{said}); {}",
                if self.auth.is_some() {
                    "check the credentials in MLFLOW_TRACKING_TOKEN or \
                     MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
                } else {
                    "it needs credentials: set MLFLOW_TRACKING_TOKEN, or \
                     MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
                }
            )),
            429 => SinkError::passing(format!(
                "MLflow at {at} is limiting requests (HTTP 429 to {what}{said})"
            )),
            500.. => SinkError::passing(format!(
                "MLflow at {at} failed {what} (HTTP {status}{said}); the server (or \
                 a proxy before it) is failing or restarting; its log says why"
            )),
            404 if code.is_none() => SinkError::lasting(format!(
                "{at} has no {path} (HTTP 404); is it the address of an MLflow tracking \
                 server, with its path prefix if it has one? {URI_HINT}"
            )),
            _ => SinkError::lasting(format!(
                "MLflow at {at} rejected {what} (HTTP {status}{said})"
            )),
        };
        Failure { code, error }
    }

    /// A request that got no answer: the connection or the network failed.
    fn unreachable(&self, t: &ureq::Transport, what: &str) -> SinkError {
        use std::io::ErrorKind as Io;
        use ureq::ErrorKind as K;
        let at = &self.base;
        let io = std::error::Error::source(t).and_then(|s| s.downcast_ref::<std::io::Error>());
        let unreachable = |why: &str| {
            SinkError::passing(format!(
                "MLflow at {at} unreachable ({why}); is the server running? {URI_HINT}"
            ))
        };
        match (t.kind(), io.map(std::io::Error::kind)) {
            (K::InvalidUrl | K::UnknownScheme, _) => SinkError::lasting(format!(
                "MLflow's address {at:?} is not an http(s) URL ({t}); {URI_HINT}"
            )),
            (kind, Some(Io::TimedOut | Io::WouldBlock)) => SinkError::passing(format!(
                "MLflow at {at} did not answer {what} in time ({}); is the server \
                 overloaded or the network down? {URI_HINT}",
                match kind {
                    K::ConnectionFailed => "no connection within 5 s",
                    _ => "no answer within 10 s",
                }
            )),
            (K::Dns, _) => unreachable("its host name does not resolve"),
            (_, Some(Io::ConnectionRefused)) => unreachable("connection refused"),
            (
                _,
                Some(
                    Io::ConnectionReset
                    | Io::ConnectionAborted
                    | Io::BrokenPipe
                    | Io::UnexpectedEof,
                ),
            ) => unreachable("the connection was dropped"),
            (_, Some(_)) => unreachable(&io.map(|e| e.to_string()).unwrap_or_default()),
            (kind, None) => unreachable(&match t.message() {
                Some(m) => format!("{kind}: {m}"),
                None => kind.to_string(),
            }),
        }
    }

    /// The experiment's id, creating the experiment when the server has none of that name.
    fn experiment_id(&self) -> Result<String, SinkError> {
        let name = &self.opts.experiment;
        let by_name = |s: &Self| {
            s.call(
                "GET",
                "experiments/get-by-name",
                json!({ "experiment_name": name }),
            )
        };
        let found = match by_name(self) {
            Ok(v) => v,
            Err(f) if f.is("RESOURCE_DOES_NOT_EXIST") => {
                match self.call("POST", "experiments/create", json!({ "name": name })) {
                    Ok(v) => return text(&v, "/experiment_id", "experiments/create"),
                    // Another rank or run created it meanwhile.
                    Err(f) if f.is("RESOURCE_ALREADY_EXISTS") => by_name(self)?,
                    Err(f) => return Err(f.into()),
                }
            }
            Err(f) => return Err(f.into()),
        };
        let id = text(
            &found,
            "/experiment/experiment_id",
            "experiments/get-by-name",
        )?;
        if found.pointer("/experiment/lifecycle_stage") == Some(&json!("deleted")) {
            return Err(SinkError::lasting(format!(
                "MLflow experiment {name:?} at {} is deleted (it keeps its name until the \
                 server's `mlflow gc`); restore it (`mlflow experiments restore \
                 --experiment-id {id}`) or choose another logging.mlflow.experiment",
                self.base
            )));
        }
        Ok(id)
    }

    /// The run to continue: the one this sink started (a start after a failure), else, on
    /// `resume`, the run file's when it was made at this address. Err: why not (for the line).
    fn earlier_run(&self) -> Result<RunIds, String> {
        if let Some(run) = &self.run {
            return Ok(run.clone());
        }
        if !self.opts.resume {
            return Err(String::new());
        }
        let path = &self.opts.run_file;
        let contents = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(String::new()),
            Err(e) => return Err(format!("{} unreadable ({e})", path.display())),
        };
        let ids: RunIds = serde_json::from_str(&contents)
            .map_err(|e| format!("{} is not a run file ({e})", path.display()))?;
        // Files from before credentials were kept out of them may hold some.
        let at = redacted(&ids.tracking_uri);
        if at.trim_end_matches('/') != self.base {
            return Err(format!("the run in {} is at {at}", path.display()));
        }
        Ok(ids)
    }

    /// `runs/get` of `earlier` when it can be continued: it exists, is not deleted and is in
    /// experiment `eid`; Ok(Err(why not)) when it cannot.
    fn continuable(&self, earlier: &RunIds, eid: &str) -> Result<Result<Value, String>, SinkError> {
        let id = &earlier.run_id;
        let got = match self.call("GET", "runs/get", json!({ "run_id": id })) {
            Ok(v) => v,
            Err(f) if f.is("RESOURCE_DOES_NOT_EXIST") => {
                return Ok(Err(format!("run {id} is not on the server")))
            }
            Err(f) => return Err(f.into()),
        };
        let run = got.get("run").cloned().unwrap_or(Value::Null);
        let info = |k: &str| run.pointer(&format!("/info/{k}")).and_then(Value::as_str);
        Ok(if info("lifecycle_stage") == Some("deleted") {
            Err(format!("run {id} is deleted"))
        } else if info("experiment_id") != Some(eid) {
            Err(format!("run {id} is in another experiment"))
        } else {
            Ok(run)
        })
    }

    /// The highest step of `train/loss` the server has for `run_id` (None: none).
    fn last_step(&self, run_id: &str) -> Result<Option<u64>, SinkError> {
        let mut last = None;
        let mut token: Option<String> = None;
        loop {
            let mut query = json!({
                "run_id": run_id, "metric_key": STEP_KEY, "max_results": HISTORY_PAGE
            });
            if let Some(t) = &token {
                query["page_token"] = json!(t);
            }
            let page = self.call("GET", "metrics/get-history", query)?;
            let points = page.get("metrics").and_then(Value::as_array);
            for p in points.into_iter().flatten() {
                // int64 fields may come as JSON strings (protobuf's JSON form).
                let step = match p.get("step") {
                    Some(Value::String(s)) => s.parse::<u64>().ok(),
                    Some(v) => v.as_u64(),
                    None => Some(0),
                };
                last = last.max(step);
            }
            token = page
                .get("next_page_token")
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
                .map(str::to_string);
            if token.is_none() || points.is_none_or(Vec::is_empty) {
                return Ok(last);
            }
        }
    }

    /// Sends `items` as the `field` list of `runs/log-batch` requests for `run_id`,
    /// `per_request` at a time.
    fn log_batch(
        &self,
        run_id: &str,
        field: &str,
        items: Vec<Value>,
        per_request: usize,
    ) -> Result<(), SinkError> {
        for chunk in items.chunks(per_request) {
            let mut body = Map::new();
            body.insert("run_id".into(), json!(run_id));
            body.insert(field.into(), Value::Array(chunk.to_vec()));
            self.call("POST", "runs/log-batch", Value::Object(body))?;
        }
        Ok(())
    }

    /// Logs the params the run does not have yet (`existing`: the run's params); a value changed
    /// since becomes a `lockstep.changed.<key>` tag, a value cut to MLflow's limit a
    /// `lockstep.truncated.<key>` one.
    fn log_params(&self, run_id: &str, existing: &Value) -> Result<(), SinkError> {
        let had: std::collections::HashMap<&str, &str> = existing
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| Some((p.get("key")?.as_str()?, p.get("value")?.as_str()?)))
            .collect();
        let mut params = Vec::new();
        let mut tags = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (key, value) in &self.opts.params {
            let key = entity_key(key);
            if !seen.insert(key.clone()) {
                continue;
            }
            let mut value = value.clone();
            let chars = value.chars().count();
            if chars > PARAM_VALUE_CHARS {
                value = value.chars().take(PARAM_VALUE_CHARS).collect();
                tags.push(tag(
                    &format!("lockstep.truncated.{key}"),
                    &format!("{chars} characters, cut to MLflow's {PARAM_VALUE_CHARS}"),
                ));
            }
            match had.get(key.as_str()) {
                None => params.push(json!({ "key": key, "value": value })),
                Some(old) if *old == value => {}
                Some(old) => tags.push(tag(
                    &format!("lockstep.changed.{key}"),
                    &format!("{old} -> {value}"),
                )),
            }
        }
        self.log_batch(run_id, "params", params, PARAMS_PER_BATCH)?;
        self.log_batch(run_id, "tags", tags, TAGS_PER_BATCH)
    }

    /// The run's own tags and lockstep's: name, user, source.
    fn run_tags(&self) -> Vec<Value> {
        let mut tags = vec![
            tag("mlflow.runName", &self.opts.run_name),
            tag("mlflow.source.name", "lockstep"),
            tag("mlflow.source.type", "LOCAL"),
        ];
        if let Ok(user) = std::env::var("USER") {
            tags.push(tag("mlflow.user", &user));
        }
        tags.extend(self.opts.tags.iter().map(|(k, v)| tag(k, v)));
        tags
    }
}

impl Sink for MlflowSink {
    /// Finds or creates the experiment, continues or creates the run (keeping its id in the
    /// run file) and logs the params. Returns the run's address and, for a continued run, the
    /// last step of `train/loss` the server has.
    fn start(&mut self) -> Result<(String, Option<u64>), SinkError> {
        if url::Url::parse(&self.base).is_err() {
            return Err(SinkError::lasting(format!(
                "MLflow's address {:?} is not a URL; {URI_HINT}",
                self.base
            )));
        }
        let eid = self.experiment_id()?;
        // The run to continue, or why there is none ("": none was asked for).
        let earlier = match self.earlier_run() {
            Ok(ids) => self.continuable(&ids, &eid)?.map(|run| (ids.run_id, run)),
            Err(why) => Err(why),
        };
        let (run_id, existing, last, note) = match earlier {
            Ok((run_id, run)) => {
                let update = json!({ "run_id": run_id, "status": "RUNNING" });
                self.call("POST", "runs/update", update)?;
                // Tags are mutable: the world size or version may have changed.
                let tags = self.opts.tags.iter().map(|(k, v)| tag(k, v)).collect();
                self.log_batch(&run_id, "tags", tags, TAGS_PER_BATCH)?;
                let last = self.last_step(&run_id)?;
                let params = run.pointer("/data/params").cloned().unwrap_or(Value::Null);
                (run_id, params, last, " (continued)".to_string())
            }
            Err(why) => {
                let create = json!({
                    "experiment_id": eid,
                    "run_name": self.opts.run_name,
                    "start_time": now_ms(),
                    "tags": self.run_tags(),
                });
                let created = self.call("POST", "runs/create", create)?;
                let run_id = text(&created, "/run/info/run_id", "runs/create")?;
                let note = match why.is_empty() {
                    true => String::new(),
                    false => format!(" (a new run: {why})"),
                };
                (run_id, Value::Null, None, note)
            }
        };
        let ids = RunIds {
            tracking_uri: self.base.clone(),
            experiment_id: eid.clone(),
            run_id: run_id.clone(),
        };
        self.run = Some(ids.clone());
        let json = serde_json::to_string_pretty(&ids).unwrap_or_default();
        let kept = crate::sys::durable::write_atomic(&self.opts.run_file, json.as_bytes());
        self.log_params(&run_id, &existing)?;
        let mut line = format!(
            "run {run_id} in experiment {:?} at {}/#/experiments/{eid}/runs/{run_id}{note}",
            self.opts.experiment, self.base
        );
        if let Err(e) = kept {
            line.push_str(&format!(
                "; cannot keep its id ({e:#}), so a resume will start a new run"
            ));
        }
        Ok((line, last))
    }

    /// Logs the records' values as metrics, in step order, [`METRICS_PER_BATCH`] a request.
    fn send(&mut self, records: &[Record]) -> Result<(), SinkError> {
        let timestamp = now_ms();
        let metrics: Vec<Value> = records
            .iter()
            .flat_map(|r| {
                r.values.iter().map(move |(key, value)| {
                    json!({
                        "key": entity_key(key),
                        "value": number(*value),
                        "timestamp": timestamp,
                        "step": r.step,
                    })
                })
            })
            .collect();
        let Some(run) = &self.run else {
            return Err(SinkError::passing("MLflow: no run started"));
        };
        self.log_batch(&run.run_id, "metrics", metrics, METRICS_PER_BATCH)
    }

    /// Ends the run with `status` and the time now.
    fn finish(&mut self, status: RunStatus) -> Result<(), SinkError> {
        let Some(run) = &self.run else { return Ok(()) };
        self.call(
            "POST",
            "runs/update",
            json!({ "run_id": run.run_id, "status": status.mlflow(), "end_time": now_ms() }),
        )?;
        Ok(())
    }
}

/// A string at `pointer` in an answer, or a lasting error naming the odd answer.
fn text(v: &Value, pointer: &str, what: &str) -> Result<String, SinkError> {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| {
            SinkError::lasting(format!(
                "MLflow's answer to {what} has no {pointer}; is the server an MLflow tracking \
                 server? {URI_HINT}"
            ))
        })
}

/// `{"key": k, "value": v}` with MLflow's limits applied.
fn tag(key: &str, value: &str) -> Value {
    let value: String = value.chars().take(TAG_VALUE_CHARS).collect();
    json!({ "key": entity_key(key), "value": value })
}

/// `name` as MLflow accepts a metric, param or tag key: letters, digits, `_ - . / ` and space
/// (anything else becomes `_`), at most 250 characters.
fn entity_key(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_alphanumeric() || "_-./ ".contains(c) {
                c
            } else {
                '_'
            }
        })
        .take(KEY_CHARS)
        .collect()
}

/// A metric value as protobuf's JSON writes a double: non-finite ones as strings.
fn number(v: f64) -> Value {
    match v {
        v if v.is_nan() => json!("NaN"),
        f64::INFINITY => json!("Infinity"),
        f64::NEG_INFINITY => json!("-Infinity"),
        v => json!(v),
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The first line of a server's message, at most 300 characters (MLflow's messages can carry
/// an SQL statement).
fn first_line(m: &str) -> String {
    let line = m.lines().next().unwrap_or("");
    match line.char_indices().nth(300) {
        Some((i, _)) => format!("{}...", &line[..i]),
        None => line.to_string(),
    }
}

/// Standard base64 with padding (for basic auth).
fn base64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"user:p@ss"), "dXNlcjpwQHNz");
    }

    #[test]
    fn keys_are_made_acceptable_and_non_finite_values_are_strings() {
        assert_eq!(entity_key("data.sources[0].path"), "data.sources_0_.path");
        assert_eq!(entity_key("val/loss/web-en"), "val/loss/web-en");
        assert_eq!(number(f64::NAN), json!("NaN"));
        assert_eq!(number(f64::NEG_INFINITY), json!("-Infinity"));
        assert_eq!(number(0.5), json!(0.5));
    }
}
