//! TensorBoard event files written by `EventWriter` read back by TensorBoard itself (the venv's
//! `tensorboard` package): every record passes TensorBoard's CRC checks and protobuf parser,
//! and `EventAccumulator` returns the scalar series with their steps and float32 values.

use crate::common;

use std::process::Command;

use lockstep::telemetry::tensorboard::EventWriter;
use serde_json::Value;

const READER: &str = r#"
import json, struct, sys
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

path, logdir = sys.argv[1], sys.argv[2]
# Strict pass over the raw records: CRCs must match and each payload must parse as an Event.
events = []
with open(path, "rb") as f:
    data = f.read()
pos = 0
while pos < len(data):
    header = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    (hcrc,) = struct.unpack("<I", data[pos + 8:pos + 12])
    assert hcrc == masked_crc32c(header), "header crc at %d" % pos
    body = data[pos + 12:pos + 12 + length]
    (bcrc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
    assert bcrc == masked_crc32c(body), "data crc at %d" % pos
    ev = event_pb2.Event.FromString(body)
    assert ev.SerializeToString() == body, "non-canonical encoding at %d" % pos
    events.append(ev)
    pos += 16 + length
assert events[0].file_version == "brain.Event:2", events[0]
walls = [e.wall_time for e in events]
assert walls == sorted(walls) and walls[0] > 1.6e9, walls

acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.SCALARS: 0})
acc.Reload()
out = {"file_version": acc.file_version, "records": len(events), "scalars": {}}
for tag in acc.Tags()["scalars"]:
    out["scalars"][tag] = [[e.step, repr(e.value)] for e in acc.Scalars(tag)]
print(json.dumps(out))
"#;

#[test]
fn tensorboard_reads_our_scalars() {
    let dir = tempfile::tempdir().unwrap();
    let logdir = dir.path().join("run/tensorboard");
    let mut w = EventWriter::create(&logdir).unwrap();
    let steps = [1i64, 2, 3, 10, 5_000_000_000];
    let series = |tag: &str, step: i64| -> f64 {
        let s = step as f64;
        match tag {
            "train/loss" => 10.0 / (1.0 + s.ln()),
            "train/lr" => 3e-4 * (s / 10.0).min(1.0),
            "train/grad_norm" => 0.812_345_678 + s * 1e-3,
            "perf/tokens_per_s" => 123_456.789 * s,
            _ => -1.5 * s,
        }
    };
    let tags = [
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "memory/rss_gb",
    ];
    for &step in &steps {
        for tag in tags {
            w.scalar(tag, step, series(tag, step)).unwrap();
        }
        w.flush().unwrap();
    }
    w.scalar("special", 1, f64::INFINITY).unwrap();
    w.scalar("special", 2, f64::NAN).unwrap();
    let path = w.path().to_path_buf();
    drop(w);

    let py = common::python();
    let out = Command::new(&py)
        .args(["-c", READER])
        .arg(&path)
        .arg(&logdir)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}; run scripts/test.sh", py.display()));
    assert!(
        out.status.success(),
        "TensorBoard could not read {} (is tensorboard installed? scripts/env.sh installs \
         scripts/requirements.txt):\n{}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    // EventAccumulator keeps the number of "brain.Event:2" (the raw string is checked above).
    assert_eq!(got["file_version"], 2.0);
    assert_eq!(got["records"], 1 + steps.len() * tags.len() + 2);
    let scalars = got["scalars"].as_object().unwrap();
    let mut names: Vec<&str> = scalars.keys().map(String::as_str).collect();
    names.sort();
    let mut want: Vec<&str> = tags.iter().copied().chain(["special"]).collect();
    want.sort();
    assert_eq!(names, want);
    let points = |tag: &str| -> Vec<(i64, f64)> {
        scalars[tag]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let v: f64 = p[1].as_str().unwrap().parse().unwrap();
                (p[0].as_i64().unwrap(), v)
            })
            .collect()
    };
    for tag in tags {
        let expect: Vec<(i64, f64)> = steps
            .iter()
            .map(|&s| (s, series(tag, s) as f32 as f64))
            .collect();
        assert_eq!(points(tag), expect, "{tag}");
    }
    let special = points("special");
    assert_eq!(special[0], (1, f64::INFINITY));
    assert!(special[1].0 == 2 && special[1].1.is_nan());
}

/// A resumed run writes a second file that starts with `SessionLog.START` at its first new
/// step: TensorBoard drops the first file's points from that step on, keeping the earlier ones.
#[test]
fn resumed_run_replaces_replayed_steps() {
    let dir = tempfile::tempdir().unwrap();
    let logdir = dir.path().join("tb");
    let mut first = EventWriter::create(&logdir).unwrap();
    for step in 1..=5 {
        first.scalar("train/loss", step, step as f64).unwrap();
    }
    let first_path = first.path().to_path_buf();
    drop(first);
    // Resumed from the step-3 checkpoint: steps 4 and 5 run again, with other values.
    let mut second = EventWriter::create(&logdir).unwrap();
    assert!(
        second.path() > first_path.as_path(),
        "files must sort in creation order"
    );
    second.session_start(4).unwrap();
    for step in 4..=6 {
        second
            .scalar("train/loss", step, 10.0 * step as f64)
            .unwrap();
    }
    drop(second);
    let code = r#"
import sys
from tensorboard.backend.event_processing import event_accumulator
acc = event_accumulator.EventAccumulator(sys.argv[1])
acc.Reload()
print(" ".join("%d:%g" % (e.step, e.value) for e in acc.Scalars("train/loss")))
"#;
    let out = Command::new(common::python())
        .args(["-c", code])
        .arg(&logdir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "1:1 2:2 3:3 4:40 5:50 6:60"
    );
}
