//! The MLflow sink against a real `mlflow server` (the venv's), read back with MLflow's own
//! Python client; and against dead, hanging and odd servers.

use crate::common;

use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

use common::canned_http;
use common::mlflow::{history, read_run, MlflowServer};
use lockstep::dist::free_port;

use lockstep::telemetry::mlflow::{MlflowOptions, MlflowSink};
use lockstep::telemetry::tracker::{Record, RunStatus, Sink, Tracker, FINISH_WAIT};
use serde_json::Value;

/// The run id a sink kept in its run file.
fn run_id_in(run_file: &Path) -> String {
    let ids: Value = serde_json::from_str(&std::fs::read_to_string(run_file).unwrap()).unwrap();
    ids["run_id"].as_str().unwrap().to_string()
}

// ---- the tests ----

fn options(uri: &str, run_file: &Path, resume: bool, params: &[(&str, &str)]) -> MlflowOptions {
    let pairs = |v: &[(&str, &str)]| {
        v.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    MlflowOptions {
        credentials: None,
        tracking_uri: uri.to_string(),
        experiment: "lockstep-test".into(),
        run_name: "sink-test".into(),
        run_file: run_file.to_path_buf(),
        resume,
        params: pairs(params),
        tags: pairs(&[("lockstep.version", "0.1.0"), ("lockstep.world_size", "2")]),
    }
}

/// Step `s`'s values: a loss and lr with full mantissas, a validation loss every 5th step, and
/// a gradient norm that is NaN at step 7 and infinite at step 8. `shift` marks values sent again.
fn record(s: u64, shift: f64) -> Record {
    let x = s as f64;
    let mut values = vec![
        (
            "train/loss".to_string(),
            std::f64::consts::PI / x.sqrt() + shift,
        ),
        (
            "train/lr".to_string(),
            3e-4 * (x / 7.0).sin().abs() + 1e-9 / 3.0,
        ),
        (
            "train/grad_norm".to_string(),
            match s {
                7 => f64::NAN,
                8 => f64::INFINITY,
                _ => 1.0 / 3.0 + x,
            },
        ),
    ];
    if s.is_multiple_of(5) {
        values.push(("val/loss".to_string(), 2.0 + 1.0 / x + shift));
    }
    Record { step: s, values }
}

/// The (step, value) pairs of `key` in `records`.
fn sent(records: &[Record], key: &str) -> Vec<(u64, f64)> {
    records
        .iter()
        .flat_map(|r| {
            r.values
                .iter()
                .filter(|(k, _)| k == key)
                .map(move |(_, v)| (r.step, *v))
        })
        .collect()
}

fn assert_same_points(got: &[(u64, f64)], want: &[(u64, f64)], key: &str) {
    assert_eq!(got.len(), want.len(), "{key}: {got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        let same = g.0 == w.0
            && (g.1 == w.1 || (g.1.is_nan() && w.1.is_nan())
                // MLflow stores an infinity as the largest double.
                || (w.1.is_infinite() && g.1.abs() == f64::MAX && g.1.signum() == w.1.signum()));
        assert!(same, "{key}: got {g:?}, sent {w:?}");
    }
}

const KEYS: [&str; 4] = ["train/loss", "train/lr", "train/grad_norm", "val/loss"];

#[test]
fn a_run_is_logged_and_a_resume_continues_it_without_repeating_steps() {
    let dir = tempfile::tempdir().unwrap();
    let server = MlflowServer::shared();
    let uri = server.uri();
    let run_file = dir.path().join("run").join("mlflow.json");
    let params = [
        ("training.learning_rate", "0.0003"),
        ("training.max_steps", "25"),
        ("model.name", "llama-tiny"),
    ];

    // A new run (a trailing '/' in the address is fine).
    let sink = MlflowSink::new(options(&format!("{uri}/"), &run_file, false, &params));
    let tracker = Tracker::start("MLflow", "[CPU0]", "", Box::new(sink));
    let first: Vec<Record> = (1..=25).map(|s| record(s, 0.0)).collect();
    for r in &first {
        tracker.send(r.clone());
    }
    tracker.finish(RunStatus::Finished, FINISH_WAIT);
    let run_id = run_id_in(&run_file);
    let run = read_run(&uri, &run_id, &KEYS);
    for key in KEYS {
        assert_same_points(&history(&run, key), &sent(&first, key), key);
    }
    let want_params: serde_json::Map<String, Value> = params
        .iter()
        .map(|(k, v)| (k.to_string(), Value::from(*v)))
        .collect();
    assert_eq!(run["params"], Value::Object(want_params.clone()));
    assert_eq!(run["status"], "FINISHED");
    assert_eq!(run["tags"]["mlflow.runName"], "sink-test");
    assert_eq!(run["tags"]["lockstep.world_size"], "2");

    // Resumed at step 19 with max_steps raised: steps 20-25 (already there) are not sent again
    // (their values here differ, to tell), 26-30 are.
    let changed = [
        ("training.learning_rate", "0.0003"),
        ("training.max_steps", "30"),
        ("model.name", "llama-tiny"),
        ("data.seed", "7"),
    ];
    let sink = MlflowSink::new(options(&uri, &run_file, true, &changed));
    let tracker = Tracker::start("MLflow", "[CPU0]", "", Box::new(sink));
    for s in 20..=30 {
        tracker.send(record(s, if s <= 25 { 100.0 } else { 0.0 }));
    }
    tracker.finish(RunStatus::Failed, FINISH_WAIT);
    assert_eq!(run_id_in(&run_file), run_id, "the resume made a new run");
    let run = read_run(&uri, &run_id, &KEYS);
    let all: Vec<Record> = (1..=30).map(|s| record(s, 0.0)).collect();
    for key in KEYS {
        assert_same_points(&history(&run, key), &sent(&all, key), key);
    }
    let steps: Vec<u64> = history(&run, "train/loss").iter().map(|p| p.0).collect();
    assert_eq!(steps, (1..=30).collect::<Vec<_>>());
    assert_eq!(run["status"], "FAILED");
    assert_eq!(run["run_id"], run_id.as_str());
    // Params are immutable: the old value stays, the change is a tag; a new key is logged.
    assert_eq!(run["params"]["training.max_steps"], "25");
    assert_eq!(run["params"]["data.seed"], "7");
    assert_eq!(
        run["tags"]["lockstep.changed.training.max_steps"],
        "25 -> 30"
    );

    // resume = false: a new run, and the run file names it. MLflow's limits are kept: 100
    // params and 1000 metrics a request, 6000 characters a param value, its key characters.
    let long = "x".repeat(7000);
    let mut many: Vec<(String, String)> = (0..150)
        .map(|i| (format!("extra.p{i:03}"), i.to_string()))
        .collect();
    many.push(("model.long".into(), long.clone()));
    many.push(("data.sources[0].path".into(), "/corpus".into()));
    let mut opts = options(&uri, &run_file, false, &[]);
    opts.params = many;
    let mut sink = MlflowSink::new(opts);
    let (line, last) = sink.start().unwrap();
    assert_eq!(last, None);
    let new_id = run_id_in(&run_file);
    assert_ne!(new_id, run_id);
    assert!(line.contains(&new_id), "{line}");
    assert!(line.contains(&format!("{uri}/#/experiments/")), "{line}");
    let wide = Record {
        step: 1,
        values: (0..1500).map(|i| (format!("m/{i:04}"), i as f64)).collect(),
    };
    sink.send(&[wide]).unwrap();
    sink.finish(RunStatus::Killed).unwrap();
    let run = read_run(&uri, &new_id, &[]);
    assert_eq!(run["params"].as_object().unwrap().len(), 152);
    assert_eq!(run["params"]["extra.p149"], "149");
    assert_eq!(run["params"]["model.long"], &long[..6000]);
    assert_eq!(run["params"]["data.sources_0_.path"], "/corpus");
    assert_eq!(
        run["tags"]["lockstep.truncated.model.long"],
        "7000 characters, cut to MLflow's 6000"
    );
    let latest = run["latest"].as_object().unwrap();
    assert_eq!(latest.len(), 1500);
    assert_eq!(latest["m/1499"], 1499.0);
    assert_eq!(run["status"], "KILLED");
}

#[test]
fn a_server_that_dies_holds_nothing_up_and_delivery_resumes_when_it_is_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = MlflowServer::start(dir.path());
    let uri = server.uri();
    let run_file = dir.path().join("mlflow.json");
    let sink = MlflowSink::new(options(&uri, &run_file, false, &[("a", "1")]));
    let tracker = Tracker::start("MLflow", "[CPU0]", "", Box::new(sink));
    for s in 1..=10 {
        tracker.send(record(s, 0.0));
    }
    // Wait for the 10 to be there, then kill the server.
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(5))
        .build();
    let t = Instant::now();
    loop {
        let delivered = std::fs::read_to_string(&run_file)
            .ok()
            .and_then(|text| serde_json::from_str::<Value>(&text).ok())
            .and_then(|ids| {
                let url = format!("{uri}/api/2.0/mlflow/metrics/get-history");
                let answer = agent
                    .get(&url)
                    .query("run_id", ids["run_id"].as_str()?)
                    .query("metric_key", "train/loss")
                    .call()
                    .ok()?;
                let history: Value = serde_json::from_reader(answer.into_reader()).ok()?;
                Some(history["metrics"].as_array().map_or(0, Vec::len))
            });
        if delivered == Some(10) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "10 records not delivered in 60 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    server.kill();

    // Records keep coming while the server is away: sending never waits on it.
    let mut slowest = Duration::ZERO;
    for s in 11..=30 {
        let t = Instant::now();
        tracker.send(record(s, 0.0));
        slowest = slowest.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(slowest < Duration::from_secs(1), "a send took {slowest:?}");

    // Back on the same port and store: what waited is delivered, once.
    let _server = MlflowServer::start_on(dir.path(), server.port);
    let t = Instant::now();
    tracker.finish(RunStatus::Finished, FINISH_WAIT);
    assert!(t.elapsed() < FINISH_WAIT, "finish took {:?}", t.elapsed());
    let run = read_run(&uri, &run_id_in(&run_file), &["train/loss"]);
    let steps: Vec<u64> = history(&run, "train/loss").iter().map(|p| p.0).collect();
    assert_eq!(steps, (1..=30).collect::<Vec<_>>());
    assert_eq!(run["status"], "FINISHED");
}

#[test]
fn dead_hanging_and_odd_servers_give_bounded_waits_and_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let run_file = dir.path().join("mlflow.json");
    let sink_at = |uri: &str| MlflowSink::new(options(uri, &run_file, true, &[]));

    // Nothing listening: a passing error naming the address and the fix.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let e = sink_at(&dead).start().unwrap_err();
    assert!(!e.lasting, "{}", e.message);
    assert!(
        e.message.contains(&dead)
            && e.message.contains("connection refused")
            && e.message.contains("MLFLOW_TRACKING_URI"),
        "{}",
        e.message
    );
    // ... and a tracker on it ends within a few seconds, never blocking a send.
    let tracker = Tracker::start("MLflow", "[CPU0]", "", Box::new(sink_at(&dead)));
    let t = Instant::now();
    for s in 1..=50 {
        tracker.send(record(s, 0.0));
    }
    assert!(t.elapsed() < Duration::from_secs(1));
    tracker.finish(RunStatus::Finished, FINISH_WAIT);
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());

    // A server that accepts and never answers: finish gives up after its wait.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let hanging = format!("http://127.0.0.1:{}", listener.local_addr().unwrap().port());
    std::thread::spawn(move || {
        let held: Vec<_> = listener.incoming().collect();
        drop(held);
    });
    let tracker = Tracker::start("MLflow", "[CPU0]", "", Box::new(sink_at(&hanging)));
    let t = Instant::now();
    tracker.send(record(1, 0.0));
    tracker.finish(RunStatus::Finished, Duration::from_secs(3));
    let took = t.elapsed();
    assert!(
        took >= Duration::from_secs(3) && took < Duration::from_secs(6),
        "{took:?}"
    );
    // Finding 12d: each request is bounded (10 s, said in the one warning); a tracker failing
    // when the run ends waits FAILING_WAIT, not the minute (tracker::tests).
    let e = sink_at(&hanging).start().unwrap_err();
    assert!(
        e.message.contains("did not answer") && e.message.contains("no answer within 10 s"),
        "{}",
        e.message
    );

    // Refused credentials: lasting, naming the variables.
    let port = canned_http(
        "HTTP/1.1 401 Unauthorized\r\nContent-Type: text/plain\r\nContent-Length: 12\r\n\
         Connection: close\r\n\r\nUnauthorized",
    );
    let e = sink_at(&format!("http://127.0.0.1:{port}"))
        .start()
        .unwrap_err();
    eprintln!("{}", e.message);
    assert!(
        e.lasting && e.message.contains("MLFLOW_TRACKING_TOKEN"),
        "{}",
        e.message
    );

    // A server error: passing.
    let port = canned_http(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    );
    let e = sink_at(&format!("http://127.0.0.1:{port}"))
        .start()
        .unwrap_err();
    eprintln!("{}", e.message);
    assert!(!e.lasting && e.message.contains("503"), "{}", e.message);

    // A refusal with MLflow's JSON error: lasting, with its code and message.
    let port = canned_http(
        "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 69\r\n\
         Connection: close\r\n\r\n\
         {\"error_code\": \"INVALID_PARAMETER_VALUE\", \"message\": \"bad name: xyz\"}",
    );
    let e = sink_at(&format!("http://127.0.0.1:{port}"))
        .start()
        .unwrap_err();
    eprintln!("{}", e.message);
    assert!(
        e.lasting
            && e.message.contains("INVALID_PARAMETER_VALUE")
            && e.message.contains("bad name: xyz"),
        "{}",
        e.message
    );

    // Not MLflow at all (a web page): lasting, no panic.
    let port = canned_http(
        "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 13\r\n\
         Connection: close\r\n\r\n<html></html>",
    );
    let e = sink_at(&format!("http://127.0.0.1:{port}"))
        .start()
        .unwrap_err();
    eprintln!("{}", e.message);
    assert!(e.lasting && e.message.contains("MLflow"), "{}", e.message);
}
