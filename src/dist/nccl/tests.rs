use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use tch::{Device, Kind, Tensor};

#[cfg(lockstep_nccl)]
use super::loader::{open_from_temp_file, TensorOpFn, SHIM_IMAGE};
use super::*;
use crate::dist::group::ProcessGroup;
use crate::dist::ring::{RingConfig, RingGroup};
use crate::dist::store::Store;

#[test]
fn watchdog_outlasts_the_ring() {
    let s = Duration::from_secs;
    assert_eq!(watchdog_timeout(s(600)), s(660));
    assert_eq!(watchdog_timeout(s(5)), s(65));
    assert_eq!(watchdog_timeout(s(3600)), s(3960));
}

/// The embedded shim loads on any machine with the wheel's libraries, GPU or not, and
/// reports an NCCL with average reduction (2.10+), which gradient averaging relies on.
#[test]
#[cfg_attr(not(lockstep_nccl), ignore = "built without the NCCL shim")]
fn shim_loads_and_reports_nccl_version() -> Result<()> {
    let v = version()?;
    let parts: Vec<u32> = v.split('.').map(|p| p.parse()).collect::<Result<_, _>>()?;
    assert_eq!(parts.len(), 3, "{v}");
    assert!((parts[0], parts[1]) >= (2, 10), "{v}");
    Ok(())
}

/// The fallback loader works too (the memfd path is the one `version()` takes here), and
/// leaves no file behind.
#[cfg(lockstep_nccl)]
#[test]
fn shim_loads_from_a_temp_file() {
    let ours = || {
        std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_string_lossy().starts_with("lockstep-nccl-")
            })
            .count()
    };
    let before = ours();
    let lib = open_from_temp_file(SHIM_IMAGE).unwrap();
    // SAFETY: the symbol's signature; it is not called.
    unsafe { lib.function::<TensorOpFn>(c"ls_nccl_all_reduce") }.unwrap();
    assert_eq!(ours(), before, "the shim's temp dir was left behind");
}

fn group_of_one(store: Arc<Store>) -> Result<NcclGroup> {
    let ring = RingGroup::with_config(
        store.clone(),
        0,
        1,
        Duration::from_secs(10),
        RingConfig::default(),
    )?;
    NcclGroup::new(store, ring, 0, "test/nccl", Duration::from_secs(10))
}

/// Without a GPU, creating the group is an error that says so, not an abort. With one (the
/// lent GPU machine runs the unit tests too), a group of one rank reduces and broadcasts
/// CUDA tensors through NCCL in place, and CPU tensors through the ring.
#[test]
#[cfg_attr(not(lockstep_nccl), ignore = "built without the NCCL shim")]
fn group_on_this_machine() -> Result<()> {
    let store = Arc::new(Store::server("127.0.0.1", 0, 1, Duration::from_secs(10))?);
    // On the GPU machine (benches/gpu/accept.sh) the CUDA branch must run: a backend that
    // fails to load there is a failure, not the CPU case.
    let want_cuda = std::env::var("LOCKSTEP_TEST_DEVICE").as_deref() == Ok("cuda");
    if !crate::sys::cuda::cuda_available() {
        assert!(
            !want_cuda,
            "LOCKSTEP_TEST_DEVICE=cuda but CUDA is not available to libtorch here"
        );
        let err = group_of_one(store).err().expect("no GPU here").to_string();
        assert!(
            err.contains("cannot create the NCCL process group"),
            "{err}"
        );
        assert!(
            err.to_lowercase().contains("gpu") || err.contains("CUDA"),
            "{err}"
        );
        return Ok(());
    }
    let mut g = group_of_one(store)?;
    let x = Tensor::arange(1000, (Kind::Float, Device::Cuda(0)));
    let before = x.copy();
    g.all_reduce_avg_tensor(&x)?;
    g.broadcast_tensor(&x, 0)?;
    assert!(x.equal(&before));
    let y = Tensor::arange(10, (Kind::BFloat16, Device::Cuda(0)));
    g.all_reduce_avg_tensor(&y)?;
    assert!(y.equal(&Tensor::arange(10, (Kind::BFloat16, Device::Cuda(0)))));
    let z = Tensor::ones([4], (Kind::Float, Device::Cpu));
    g.all_reduce_avg_tensor(&z)?;
    assert_eq!(z.sum(Kind::Float).double_value(&[]), 4.0);
    // The sharded optimizer's collectives (one piece at world size 1).
    g.reduce_scatter_avg_tensor(&x, &[1000])?;
    g.all_gather_tensor(&x, &[1000])?;
    assert!(x.equal(&before));
    // Expert parallelism's all-to-all (NCCL's alltoall_base on the device: one piece of
    // bf16 rows of a non-contiguous input, the whole of it to this rank).
    let rows = Tensor::arange(24, (Kind::BFloat16, Device::Cuda(0))).view([4, 6]);
    let strided = rows.tr().contiguous().tr();
    let back = g.all_to_all_tensor(&strided, &[4], &[4])?;
    assert!(back.equal(&rows) && back.device() == Device::Cuda(0));
    assert_eq!(g.all_reduce_max_f64(2.0)?, 2.0);
    g.barrier()?;
    // A collective the shim rejects is an error carrying libtorch's message.
    let strided = x.view([10, 100]).transpose(0, 1);
    let err = g.all_reduce_avg_tensor(&strided).unwrap_err().to_string();
    assert!(err.contains("NCCL all-reduce"), "{err}");
    println!(
        "NCCL {} group of one rank on cuda:0: all-reduce (fp32, bf16), broadcast, \
         reduce-scatter, all-gather, all-to-all, max, barrier: ok",
        version()?
    );
    Ok(())
}
