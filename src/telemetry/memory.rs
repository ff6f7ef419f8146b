//! Process memory from /proc/self/status: resident set (VmRSS) and its peak (VmHWM).

fn status_kb(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Resident memory in bytes (0 where /proc is unavailable).
pub fn rss_bytes() -> u64 {
    status_kb("VmRSS:").unwrap_or(0) * 1024
}

/// Peak resident memory in bytes.
pub fn peak_rss_bytes() -> u64 {
    status_kb("VmHWM:").unwrap_or(0) * 1024
}

pub fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_touched_allocation_shows_in_resident_and_peak_memory() {
        // Other tests in this process allocate and free concurrently, so compare against the
        // allocation itself (and the peak, which never goes down), not against a "before".
        // black_box: an allocation nothing reads may be removed by the optimizer altogether.
        let v = std::hint::black_box(vec![1u8; 256 << 20]);
        let rss = super::rss_bytes();
        assert!(rss >= 256 << 20, "{rss}");
        assert!(super::peak_rss_bytes() >= 256 << 20);
        drop(v);
    }
}
