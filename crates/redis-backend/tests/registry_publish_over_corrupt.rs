//! A registry entry filed under a number no policy's generation can be (above `MAX_EXACT`,
//! 2^52: a hand edit, or something else writing the hash) is `Corrupt` for every follower; the
//! publication script must not take that number for the stored generation, or it refuses every
//! publication as `Stale` until someone deletes the entry by hand. Real redis-server.

use std::time::Duration;

use tollgate_core::{MAX_EXACT, Policy, Transition};
use tollgate_redis::{Published, RedisRegistry, RegistryError};
use tollgate_testkit::server::RedisServer;

const TIMEOUT: Duration = Duration::from_secs(2);

fn hset(server: &RedisServer, value: &str) {
    let mut conn = server.client().get_connection().unwrap();
    let _: () = redis::cmd("HSET")
        .arg("tollgate:registry")
        .arg("api")
        .arg(value)
        .query(&mut conn)
        .unwrap();
}

fn policy(generation: u64) -> Policy {
    Policy::fixed_window(7, Duration::from_secs(3600))
        .unwrap()
        .with_generation(generation)
        .with_transition(Transition::Carry)
}

#[tokio::test]
async fn a_publication_replaces_an_entry_filed_under_an_impossible_generation() {
    let server = RedisServer::start();
    let reg = RedisRegistry::connect(&server.url(), "tollgate:", TIMEOUT)
        .await
        .unwrap();
    let spec = "fixed-window:limit=7,window=1h,generation=9,transition=carry";
    for prefix in [
        "99999999999999999999".to_owned(),
        (MAX_EXACT + 1).to_string(),
        u64::MAX.to_string(),
    ] {
        hset(&server, &format!("{prefix} {spec}"));
        assert!(
            matches!(reg.get("api").await, Err(RegistryError::Corrupt { .. })),
            "{prefix}"
        );
        let got = reg.publish("api", &policy(2)).await;
        assert!(matches!(got, Ok(Published::Stored)), "{prefix}: {got:?}");
        assert_eq!(reg.get("api").await.unwrap(), Some(policy(2)), "{prefix}");
    }
    // The largest generation a policy can have is a real one: an older publication is stale.
    hset(
        &server,
        &format!("{MAX_EXACT} {}", policy(MAX_EXACT).to_spec()),
    );
    assert_eq!(reg.get("api").await.unwrap(), Some(policy(MAX_EXACT)));
    let got = reg.publish("api", &policy(2)).await;
    assert!(
        matches!(got, Err(RegistryError::Stale { stored, offered: 2, .. }) if stored == MAX_EXACT),
        "{got:?}"
    );
}
