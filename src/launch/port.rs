//! The rendezvous port (`MASTER_PORT`).

use std::io::ErrorKind;
use std::net::{Ipv4Addr, TcpListener};

use anyhow::{bail, Context, Result};

use super::LaunchPlan;

/// Returns the port to export: a free one for 0, else the plan's port after checking, on
/// node 0 (the node that will listen on it), that nothing listens there yet.
pub(super) fn resolve(plan: &LaunchPlan) -> Result<u16> {
    if plan.master_port == 0 {
        return pick_free();
    }
    if plan.node_rank == 0 {
        check_free(plan.master_port, &plan.master_addr)?;
    }
    Ok(plan.master_port)
}

/// Asks the kernel for an unused port and releases it again. Another process could take it
/// before rank 0 binds it; that window is accepted (torchrun does the same).
fn pick_free() -> Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0))
        .context("picking a free port for --master-port 0")?;
    Ok(listener.local_addr()?.port())
}

/// Binds the wildcard address rather than `addr`: rank 0 listens on all interfaces, and on
/// Linux a wildcard bind fails if anything listens on the port on any address, even with the
/// SO_REUSEADDR that std sets (which still lets a port in TIME_WAIT pass, as it should).
fn check_free(port: u16, addr: &str) -> Result<()> {
    match TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == ErrorKind::AddrInUse => bail!(
            "--master-port {port}: address {addr}:{port} is already in use; \
             choose another port or 0 for a free one"
        ),
        Err(e) => Err(e).with_context(|| format!("--master-port {port}: checking {addr}:{port}")),
    }
}
