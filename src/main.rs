//! `lockstep`: parse, dispatch, map errors to exit codes (documented in README.md):
//! 0 success (also after a SIGTERM/SIGINT that saved a checkpoint), 1 runtime failure,
//! 2 bad config or usage, 3 stopped by the NaN/Inf or loss-spike guard.

use clap::Parser;

/// Before the shared libraries' constructors (see `lockstep::sys::cwd`).
#[cfg(target_os = "linux")]
#[used]
#[link_section = ".preinit_array"]
static STEP_OUT_OF_A_DELETED_CWD: extern "C" fn() = lockstep::sys::cwd::step_out;

fn main() {
    lockstep::sys::cwd::step_back();
    lockstep::sys::skip_static_destructors_at_exit();
    let cli = lockstep::cli::Cli::parse();
    if let Err(e) = lockstep::cli::run(cli) {
        let code = if e.downcast_ref::<lockstep::config::ConfigError>().is_some() {
            2
        } else if e
            .downcast_ref::<lockstep::train::guard::NanAbort>()
            .is_some()
        {
            3
        } else {
            1
        };
        // A rank of a job of several says which it is (srun tasks have no launcher to do it).
        match lockstep::telemetry::error_tag() {
            Some(tag) => eprintln!("{tag} error: {e:#}"),
            None => eprintln!("error: {e:#}"),
        }
        std::process::exit(code);
    }
}
