//! The one proxy rule of lockstep's own HTTP clients (MLflow's REST calls, Hub downloads): a
//! request goes through HTTPS_PROXY / HTTP_PROXY / ALL_PROXY (as ureq reads them) unless its
//! host is loopback or NO_PROXY (or no_proxy) names it, as curl and Python's requests decide.

/// NO_PROXY's value (else no_proxy's; empty when neither is set).
pub fn no_proxy() -> String {
    std::env::var("NO_PROXY")
        .or_else(|_| std::env::var("no_proxy"))
        .unwrap_or_default()
}

/// Whether requests to `host` go through the environment's proxy: not for loopback hosts
/// (`localhost`, 127.0.0.0/8, ::1) or those `no_proxy` (NO_PROXY's value) names: `*`, a host,
/// or a domain suffix (`.example.com` and `example.com` alike).
pub fn proxied(host: &str, no_proxy: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty()
        || host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
    {
        return false;
    }
    !no_proxy.split(',').map(str::trim).any(|entry| {
        let entry = entry.trim_start_matches('.');
        entry == "*"
            || (!entry.is_empty() && (host == entry || host.ends_with(&format!(".{entry}"))))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_no_proxy_hosts_go_direct() {
        assert!(!proxied("127.0.0.1", ""));
        assert!(!proxied("[::1]", ""));
        assert!(!proxied("localhost", ""));
        assert!(proxied("mlflow.example.com", ""));
        assert!(proxied("mlflow.example.com", "other.org, 10.0.0.1"));
        assert!(!proxied("mlflow.example.com", "other.org, .example.com"));
        assert!(!proxied("mlflow.example.com", "mlflow.example.com"));
        assert!(!proxied("mlflow.example.com", "*"));
        assert!(proxied("notexample.com", "example.com"));
        assert!(!proxied("huggingface.co", "huggingface.co"));
        assert!(!proxied("cdn-lfs.huggingface.co", ".huggingface.co"));
    }
}
