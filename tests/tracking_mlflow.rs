//! Training with MLflow on, against a real `mlflow server` on 127.0.0.1, read back with
//! MLflow's own client: the metrics are metrics.jsonl's, the params the resolved config, one
//! run across a resume, and the run's status follows the exit (FINISHED, FAILED after a NaN
//! abort, KILLED after SIGTERM). A server that goes away mid-run costs one warning.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::mlflow::{history, read_run, MlflowServer};
use common::{ok, run, small, with, write_corpus, Launcher};
use serde_json::Value;

fn args(base: &[String], uri: &str, name: &str, extra: &[&str]) -> Vec<String> {
    let uri = format!("logging.mlflow.tracking_uri={uri}");
    let name = format!("logging.run_name={name}");
    with(
        base,
        &[],
        &[
            &[
                "--set",
                &uri,
                "--set",
                "logging.mlflow.experiment=lockstep-e2e",
                "--set",
                &name,
            ],
            extra,
        ]
        .concat(),
    )
}

fn run_id(run_dir: &Path) -> String {
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("mlflow.json")).unwrap())
            .unwrap();
    v["run_id"].as_str().unwrap().to_string()
}

const KEYS: &[&str] = &[
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "guard/nonfinite",
];

/// Every logged value of the keys in [`KEYS`] equals metrics.jsonl's at the same step, each
/// step once.
fn assert_matches_the_record(run_dir: &Path, got: &Value) {
    let metrics = common::records(&run_dir.join("metrics.jsonl"));
    for key in &KEYS[..3] {
        let want: Vec<(u64, f64)> = metrics
            .iter()
            .map(|m| {
                let record: lockstep::telemetry::MetricsRecord =
                    serde_json::from_value(m.clone()).unwrap();
                let value = record
                    .series()
                    .into_iter()
                    .find(|(n, _)| n == key)
                    .unwrap()
                    .1;
                (m["step"].as_u64().unwrap(), value)
            })
            .collect();
        assert_eq!(history(got, key), want, "{key}");
    }
}

#[test]
fn mlflow_has_the_metrics_and_config_and_one_run_across_a_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let server = MlflowServer::shared();
    let base = small(&write_corpus(dir));
    let run_dir = dir.join("runs/ml");
    let text = ok(
        dir,
        &with(
            &args(&base, &server.uri(), "ml", &[]),
            &["train"],
            &["--max-steps", "12"],
        ),
    );
    assert!(text.contains("MLflow: run "), "{text}");
    let id = run_id(&run_dir);
    let got = read_run(&server.uri(), &id, KEYS);
    assert_eq!(got["status"], "FINISHED");
    assert_matches_the_record(&run_dir, &got);
    // The params are the resolved config, flattened.
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("config.json")).unwrap())
            .unwrap();
    let params = got["params"].as_object().unwrap();
    for (key, value) in lockstep::telemetry::flat_params(&config) {
        let key = key.replace(['[', ']'], "_");
        assert_eq!(
            params.get(&key).and_then(Value::as_str),
            Some(value.as_str()),
            "{key}"
        );
    }
    assert_eq!(got["tags"]["lockstep.world_size"], "1");

    // A resume with more steps: the same run, each step once, max_steps recorded as changed.
    ok(
        dir,
        &with(
            &args(&base, &server.uri(), "ml", &[]),
            &["train"],
            &["--max-steps", "16", "--resume", "auto"],
        ),
    );
    assert_eq!(run_id(&run_dir), id);
    let got = read_run(&server.uri(), &id, KEYS);
    assert_eq!(got["status"], "FINISHED");
    assert_matches_the_record(&run_dir, &got);
    assert_eq!(history(&got, "train/loss").len(), 16);
    assert_eq!(
        got["tags"]["lockstep.changed.training.max_steps"],
        "12 -> 16"
    );
}

#[test]
fn the_status_follows_the_exit_a_nan_abort_fails_and_sigterm_kills() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let server = MlflowServer::shared();
    let base = small(&write_corpus(dir));
    let nan = [
        "--set",
        "training.nan_policy=abort",
        "--set",
        "debug.inject_nan_at_step=4",
    ];
    let out = run(
        dir,
        &with(
            &args(&base, &server.uri(), "nan", &nan),
            &["train"],
            &["--max-steps", "8"],
        ),
    );
    assert_eq!(out.status.code(), Some(3), "{}", common::output_text(&out));
    let got = read_run(&server.uri(), &run_id(&dir.join("runs/nan")), KEYS);
    assert_eq!(got["status"], "FAILED");
    assert_eq!(history(&got, "guard/nonfinite"), [(4, 1.0)]);
    assert_eq!(history(&got, "train/loss").len(), 3);

    // SIGTERM: a checkpoint, exit 0, and the run KILLED (to be resumed).
    let slow = [
        "--set",
        "debug.fault=slow",
        "--set",
        "debug.fault_delay_ms=200",
    ];
    let l = Launcher::start(
        dir,
        &with(
            &args(&base, &server.uri(), "term", &slow),
            &["train"],
            &["--max-steps", "50"],
        ),
    );
    l.wait_for("Step [3/50]", Duration::from_secs(60));
    unsafe { libc::kill(l.pid() as i32, libc::SIGTERM) };
    let (code, text) = l.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{text}");
    let got = read_run(&server.uri(), &run_id(&dir.join("runs/term")), KEYS);
    assert_eq!(got["status"], "KILLED", "{text}");
}

#[test]
fn a_server_gone_mid_run_costs_one_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut server = MlflowServer::start(dir);
    let base = small(&write_corpus(dir));
    let slow = [
        "--set",
        "debug.fault=slow",
        "--set",
        "debug.fault_delay_ms=100",
    ];
    let l = Launcher::start(
        dir,
        &with(
            &args(&base, &server.uri(), "gone", &slow),
            &["train"],
            &["--max-steps", "30"],
        ),
    );
    l.wait_for("MLflow: run ", Duration::from_secs(60));
    l.wait_for("Step [5/30]", Duration::from_secs(60));
    server.kill();
    let (code, text) = l.finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{text}");
    let warnings: Vec<&str> = text.lines().filter(|x| x.contains("Warning")).collect();
    assert_eq!(warnings.len(), 1, "{text}");
    assert!(warnings[0].contains("MLflow"), "{text}");
    assert_eq!(
        common::losses(&dir.join("runs/gone/metrics.jsonl")).len(),
        30,
        "{text}"
    );
}

/// A TCP proxy on 127.0.0.1 in front of `upstream`'s port that keeps every byte a client
/// sends. Returns its port and the bytes.
fn recording_proxy(upstream: u16) -> (u16, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let sent = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = sent.clone();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                continue;
            };
            let (mut c_in, mut s_out) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            let (mut s_in, mut c_out) = (server, client);
            let kept = kept.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 65536];
                while let Ok(n @ 1..) = c_in.read(&mut buf) {
                    kept.lock().unwrap().extend_from_slice(&buf[..n]);
                    if s_out.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = s_out.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut s_in, &mut c_out);
                let _ = c_out.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    (port, sent)
}

/// Every file under `dir` that holds `secret`.
fn files_holding(dir: &Path, secret: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            let kind = entry.file_type().unwrap();
            if kind.is_dir() {
                todo.push(path);
            } else if kind.is_file() {
                let bytes = std::fs::read(&path).unwrap_or_default();
                if bytes.windows(secret.len()).any(|w| w == secret.as_bytes()) {
                    found.push(path.display().to_string());
                }
            }
        }
    }
    found
}

/// A password in logging.mlflow.tracking_uri (under `lockstep run`, 2 ranks) and in
/// MLFLOW_TRACKING_URI (`lockstep train`), with a W&B key, a Hub token and a proxy password
/// in the environment and W&B on (offline): no file under the working directory (the run
/// directory, the launcher's logs and worker spec, the data cache, W&B's files, even MLflow's
/// own database), no line printed and no byte sent to MLflow holds any of them; the MLflow
/// credentials still arrive, as the Authorization header only, and the address is recorded
/// without them.
#[test]
fn no_file_param_or_line_holds_a_planted_secret() {
    const PASSWORD: &str = "pw-in-the-config-7d1f";
    const ENV_PASSWORD: &str = "pw-in-the-variable-93ce";
    const OTHERS: [(&str, &str); 4] = [
        ("WANDB_API_KEY", "wandbkey0123456789abcdef0123456789abcdef"),
        ("HF_TOKEN", "hf_plantedtoken5b6c"),
        (
            "HTTPS_PROXY",
            "http://proxyuser:proxy-pw-41aa@10.255.255.1:3128",
        ),
        (
            "HTTP_PROXY",
            "http://proxyuser:proxy-pw-41aa@10.255.255.1:3128",
        ),
    ];
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let server = MlflowServer::shared();
    let (port, sent) = recording_proxy(server.port);
    let base = with(
        &small(&write_corpus(dir)),
        &[],
        &[
            "--max-steps",
            "2",
            "--set",
            "logging.wandb.project=secrets",
            "--set",
            "logging.wandb.mode=offline",
        ],
    );
    let bare = format!("http://127.0.0.1:{port}");
    let in_config = format!("http://alice:{PASSWORD}@127.0.0.1:{port}");
    let mut printed = String::new();
    for (name, launch) in [("cfg", true), ("env", false)] {
        let mut cmd = common::lockstep(dir);
        if launch {
            cmd.args(["run", "--cpu", "--nproc", "2"])
                .args(args(&base, &in_config, name, &[]));
        } else {
            let uri = format!("http://bob:{ENV_PASSWORD}@127.0.0.1:{port}/");
            let named = [
                "--set",
                "logging.mlflow.experiment=lockstep-e2e",
                "--set",
                "logging.run_name=env",
            ];
            cmd.arg("train")
                .args(with(&base, &[], &named))
                .env("MLFLOW_TRACKING_URI", uri);
        }
        let out = cmd.envs(OTHERS).output().unwrap();
        let text = common::output_text(&out);
        assert!(out.status.success(), "{text}");
        assert!(text.contains("MLflow: run "), "{text}");
        printed.push_str(&text);
        let got = read_run(&server.uri(), &run_id(&dir.join("runs").join(name)), KEYS);
        assert_eq!(got["status"], "FINISHED");
        if launch {
            assert_eq!(got["params"]["logging.mlflow.tracking_uri"], bare.as_str());
        }
    }
    let sent = String::from_utf8_lossy(&sent.lock().unwrap()).into_owned();
    for (who, password) in [("alice", PASSWORD), ("bob", ENV_PASSWORD)] {
        use base64::Engine;
        let basic = base64::engine::general_purpose::STANDARD.encode(format!("{who}:{password}"));
        assert!(
            sent.contains(&format!("Basic {basic}")),
            "{who}'s credentials never reached the server"
        );
    }
    let secrets = [PASSWORD, ENV_PASSWORD, "proxy-pw-41aa"]
        .into_iter()
        .chain(OTHERS.iter().take(2).map(|(_, v)| *v));
    for secret in secrets {
        assert!(!sent.contains(secret), "{secret} was sent to MLflow");
        assert!(
            !printed.contains(secret),
            "{secret} was printed:\n{printed}"
        );
        let holding = files_holding(dir, secret);
        assert!(holding.is_empty(), "{secret} is in {holding:?}");
    }
}
