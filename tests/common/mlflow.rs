//! A real `mlflow server` for the tracking tests, and MLflow's own client reading runs back.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The project venv (scripts/env.sh), which has `mlflow`.
pub fn venv_bin(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(".venv/bin")
        .join(name)
}

/// `mlflow server` on 127.0.0.1 with its SQLite store and artifacts in `dir`, in its own process
/// group (killed with everything it started when dropped). About 10 s to start on a 2-core
/// machine.
pub struct MlflowServer {
    child: Option<Child>,
    pub port: u16,
    log: PathBuf,
}

impl MlflowServer {
    /// Starts a server on a free port and waits until it answers.
    pub fn start(dir: &Path) -> MlflowServer {
        MlflowServer::start_on(dir, lockstep::dist::free_port())
    }

    /// Starts a server on `port` (a restart: the same `dir` keeps the same store).
    pub fn start_on(dir: &Path, port: u16) -> MlflowServer {
        let mlflow = venv_bin("mlflow");
        assert!(
            mlflow.exists(),
            "{} missing: run scripts/test.sh, which installs the venv",
            mlflow.display()
        );
        let log = dir.join("mlflow-server.log");
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = Command::new(&mlflow)
            .args(["server", "--host", "127.0.0.1", "--port", &port.to_string()])
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}", dir.join("mlflow.db").display()))
            .arg("--default-artifact-root")
            .arg(dir.join("artifacts"))
            .args(["--workers", "1"])
            // MLflow 3's job runner (a job process and huey consumers with 5-10 workers, each
            // importing mlflow) is not tracking: off, the server is 2 Python processes, not 10.
            .env("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("{} cannot start: {e}", mlflow.display()));
        let mut server = MlflowServer {
            child: Some(child),
            port,
            log,
        };
        // A loaded 2-core machine once took more than 60 s (round 5, finding 28): a server that
        // is alive is waited for up to 10 minutes, with a line every 20 s; one that exits fails
        // at once.
        server.wait_ready(Duration::from_secs(600));
        server
    }

    /// The server of this test process that tests share when they only log to it and read
    /// back their own runs (by id): started by the first caller (~15 s on 2 cores, each start
    /// two Python processes importing mlflow), killed with everything it started, and its
    /// store removed, when the process exits. A test that stops or restarts its server starts
    /// one of its own.
    pub fn shared() -> &'static MlflowServer {
        static SHARED: OnceLock<(MlflowServer, PathBuf)> = OnceLock::new();
        extern "C" fn at_exit() {
            if let Some((server, dir)) = SHARED.get() {
                if let Some(child) = &server.child {
                    kill_group(child);
                }
                let _ = std::fs::remove_dir_all(dir);
            }
        }
        &SHARED
            .get_or_init(|| {
                let dir = tempfile::tempdir().unwrap().keep();
                let server = MlflowServer::start(&dir);
                // SAFETY: registers a plain function; it runs once, as the process exits (libtest
                // returns from main, or calls exit() after a failure).
                assert_eq!(unsafe { libc::atexit(at_exit) }, 0);
                (server, dir)
            })
            .0
    }

    /// `http://127.0.0.1:<port>`.
    pub fn uri(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn wait_ready(&mut self, limit: Duration) {
        let t = Instant::now();
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(2))
            .build();
        let health = format!("{}/health", self.uri());
        let mut said = Instant::now();
        loop {
            if agent.get(&health).call().is_ok() {
                eprintln!(
                    "mlflow server on port {} ready after {:.1} s",
                    self.port,
                    t.elapsed().as_secs_f64()
                );
                return;
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || t.elapsed() > limit {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                self.kill();
                panic!(
                    "mlflow server on port {} {} ; its log:\n{log}",
                    self.port,
                    match exited {
                        Some(status) => format!("exited ({status}) before answering"),
                        None => format!("did not answer GET /health within {limit:?}"),
                    }
                );
            }
            if said.elapsed() > Duration::from_secs(20) {
                said = Instant::now();
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                eprintln!(
                    "mlflow server on port {} not answering yet after {:.0} s (alive; waiting up to \
                     {limit:?}); its last log line: {}",
                    self.port,
                    t.elapsed().as_secs_f64(),
                    log.lines().last().unwrap_or("(none)")
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Kills the server and everything it started (SIGKILL to its process group).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_group(&child);
            let _ = child.wait();
        }
    }
}

/// SIGKILL to the server's process group (it was started as the leader of its own group), so
/// that the workers it started die with it.
fn kill_group(server: &Child) {
    // SAFETY: a signal to the process group this test process started.
    unsafe { libc::killpg(server.id() as libc::pid_t, libc::SIGKILL) };
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What MLflow's own Python client reads of `run_id`: status, params, tags, the latest value of
/// each metric and the history of `keys` as `[step, repr(value)]` (repr keeps every bit, NaN included).
pub fn read_run(uri: &str, run_id: &str, keys: &[&str]) -> Value {
    let script = r#"
import json, sys
from mlflow.tracking import MlflowClient
c = MlflowClient()
run_id = sys.argv[1]
r = c.get_run(run_id)
print(json.dumps({
    "run_id": r.info.run_id,
    "status": r.info.status,
    "params": r.data.params,
    "tags": r.data.tags,
    "latest": r.data.metrics,
    "history": {k: [[m.step, repr(m.value)] for m in c.get_metric_history(run_id, k)]
                for k in sys.argv[2:]},
}))
"#;
    let out = Command::new(venv_bin("python"))
        .arg("-c")
        .arg(script)
        .arg(run_id)
        .args(keys)
        .env("MLFLOW_TRACKING_URI", uri)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "reading run {run_id} with MlflowClient failed:\n{}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap_or("")).unwrap()
}

/// A history from [`read_run`] as (step, value) pairs in step order.
pub fn history(run: &Value, key: &str) -> Vec<(u64, f64)> {
    let mut points: Vec<(u64, f64)> = run["history"][key]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p[0].as_u64().unwrap(),
                p[1].as_str().unwrap().parse().unwrap(),
            )
        })
        .collect();
    points.sort_by_key(|p| p.0);
    points
}
