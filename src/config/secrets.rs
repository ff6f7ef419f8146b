//! Credentials that arrive inside a config value: `logging.mlflow.tracking_uri =
//! http://user:password@host:5000`. They are taken out when the config is resolved, so no
//! stored or sent copy of the config holds them (the run's config.json, every trainer.json, the
//! launcher's worker_spec.json, MLflow's params and W&B's run config); [`Secrets`] keeps them in
//! memory for the MLflow client, and `lockstep run` hands them to its workers through their
//! environment (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD), never through a file.

use std::fmt;

use percent_encoding::percent_decode_str;

/// A user name and password (basic auth). Debug never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Credentials {{ username: {:?}, password: <hidden> }}",
            self.username
        )
    }
}

/// What resolving a config took out of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Secrets {
    /// From `logging.mlflow.tracking_uri`'s user information.
    pub mlflow: Option<Credentials>,
}

impl Secrets {
    /// Takes the credentials out of `uri` (`logging.mlflow.tracking_uri`), leaving the address
    /// without them.
    pub fn take(uri: &mut Option<String>) -> Secrets {
        let Some(u) = uri.as_mut() else {
            return Secrets::default();
        };
        let (bare, mlflow) = split_credentials(u);
        *u = bare;
        Secrets { mlflow }
    }
}

/// `scheme://user:password@host/path` → (`scheme://host/path`, the user and password
/// percent-decoded). An address without user information comes back unchanged, with None.
pub fn split_credentials(uri: &str) -> (String, Option<Credentials>) {
    let Some(start) = uri.find("://").map(|i| i + 3) else {
        return (uri.to_string(), None);
    };
    let end = uri[start..]
        .find(['/', '?', '#'])
        .map_or(uri.len(), |i| start + i);
    // The last '@' ends the user information (a password may hold an unencoded '@').
    let Some(at) = uri[start..end].rfind('@').map(|i| start + i) else {
        return (uri.to_string(), None);
    };
    let info = &uri[start..at];
    let (user, password) = info.split_once(':').unwrap_or((info, ""));
    let decode = |s: &str| percent_decode_str(s).decode_utf8_lossy().into_owned();
    let bare = format!("{}{}", &uri[..start], &uri[at + 1..]);
    (
        bare,
        Some(Credentials {
            username: decode(user),
            password: decode(password),
        }),
    )
}

/// `uri` as it may be shown: without user information.
pub fn redacted(uri: &str) -> String {
    split_credentials(uri).0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_come_out_of_the_address_and_never_show() {
        let (bare, c) =
            split_credentials("http://al%40ice:p%3Ass@w:rd@mlflow.local:5000/prefix?x=1");
        assert_eq!(bare, "http://mlflow.local:5000/prefix?x=1");
        let c = c.unwrap();
        assert_eq!(
            (c.username.as_str(), c.password.as_str()),
            ("al@ice", "p:ss@w:rd")
        );
        assert!(!format!("{c:?}").contains("ss@w"), "{c:?}");
        assert_eq!(
            split_credentials("https://host:5000").0,
            "https://host:5000"
        );
        assert!(
            split_credentials("https://host/a@b").1.is_none(),
            "an @ in the path is not user information"
        );
        let (bare, c) = split_credentials("http://token@host");
        assert_eq!(bare, "http://host");
        assert_eq!(c.unwrap().password, "");
        let mut uri = Some("http://u:secret@h:1".to_string());
        let s = Secrets::take(&mut uri);
        assert_eq!(uri.as_deref(), Some("http://h:1"));
        assert_eq!(s.mlflow.unwrap().password, "secret");
        assert_eq!(redacted("http://u:secret@h:1/x"), "http://h:1/x");
    }
}
