//! Registry entries written by hand (or by something else) against a real redis-server: an
//! entry the registry cannot order or read is a typed `Corrupt` error for that entry alone,
//! never another class of error, never a policy applied under a generation the registry does
//! not hold.

use std::time::Duration;

use tollgate_core::{MAX_EXACT, Policy, Transition};
use tollgate_redis::{Published, RedisRegistry, RegistryError};
use tollgate_testkit::server::RedisServer;

const TIMEOUT: Duration = Duration::from_secs(2);

async fn registry(server: &RedisServer) -> RedisRegistry {
    RedisRegistry::connect(&server.url(), "tollgate:", TIMEOUT)
        .await
        .unwrap()
}

/// Writes `value` under `name` in the registry's hash, as a hand edit would.
fn hset(server: &RedisServer, name: &[u8], value: &[u8]) {
    let mut conn = server.client().get_connection().unwrap();
    let _: () = redis::cmd("HSET")
        .arg("tollgate:registry")
        .arg(name)
        .arg(value)
        .query(&mut conn)
        .unwrap();
}

fn corrupt(got: &Result<Option<Policy>, RegistryError>) -> bool {
    matches!(got, Err(RegistryError::Corrupt { name, .. }) if name == "api")
}

/// The publication script orders entries by the generation before the space; followers used
/// the spec's `generation=`. An entry where the two disagree (or the prefix is missing or not
/// a number) was read as the spec's generation: followers switched to generation 9 while the
/// registry refused nothing above 1, so a later publication of generation 2 was stored,
/// announced, and ignored by every instance that had taken 9 (and taken by every instance
/// started afterwards). Such an entry is `Corrupt` now.
#[tokio::test]
async fn an_entry_whose_generations_disagree_is_corrupt() {
    let server = RedisServer::start();
    let reg = registry(&server).await;
    let spec9 = "fixed-window:limit=7,window=1h,generation=9,transition=carry";
    for value in [
        format!("1 {spec9}"),
        "9 fixed-window:limit=7,window=1h,generation=4,transition=carry".to_owned(),
        "4 fixed-window:limit=7,window=1h".to_owned(),
        spec9.to_owned(),
        format!("x {spec9}"),
        format!("+9 {spec9}"),
        format!("99999999999999999999 {spec9}"),
    ] {
        hset(&server, b"api", value.as_bytes());
        let got = reg.get("api").await;
        assert!(corrupt(&got), "{value:?}: {got:?}");
    }
    // The consistent entry, hand-written in other units, reads back.
    hset(&server, b"api", format!("9 {spec9}").as_bytes());
    assert_eq!(
        reg.get("api").await.unwrap(),
        Some(spec9.parse::<Policy>().unwrap())
    );
}

/// A value that is not UTF-8 failed `get`, `list` (hiding every other entry) and so a
/// follower's start with `Store(Script("Incompatible type - Cannot convert from UTF-8"))`: a
/// class that means a bug in tollgate. It is that entry's `Corrupt` now, and a field name that
/// is not UTF-8 is listed as a bad name.
#[tokio::test]
async fn an_entry_that_is_not_utf8_is_corrupt_and_hides_nothing() {
    let server = RedisServer::start();
    let reg = registry(&server).await;
    let good = "token-bucket:capacity=3,rate=1,generation=2,transition=carry"
        .parse::<Policy>()
        .unwrap();
    reg.publish("search", &good).await.unwrap();
    hset(&server, b"api", b"\xff\xfe 3 garbage");
    hset(
        &server,
        b"\xff",
        b"1 fixed-window:limit=1,window=1h,generation=1,transition=carry",
    );
    let got = reg.get("api").await;
    assert!(corrupt(&got), "{got:?}");
    let message = got.unwrap_err().to_string();
    assert!(message.contains("not UTF-8"), "{message}");
    let listed = reg
        .list()
        .await
        .expect("one entry does not fail the listing");
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert!(
        matches!(&listed[0].1, Err(RegistryError::Corrupt { name, .. }) if name == "api"),
        "{listed:?}"
    );
    assert_eq!(listed[1].0, "search");
    assert_eq!(listed[1].1.as_ref().unwrap(), &good);
    assert!(
        matches!(&listed[2].1, Err(RegistryError::BadName(_))),
        "{listed:?}"
    );
}

fn policy(generation: u64) -> Policy {
    Policy::fixed_window(7, Duration::from_secs(3600))
        .unwrap()
        .with_generation(generation)
        .with_transition(Transition::Carry)
}

/// A registry entry filed under a number no policy's generation can be (above `MAX_EXACT`,
/// 2^52) is `Corrupt` for every follower; the publication script must not take that number
/// for the stored generation, or it refuses every publication as `Stale` until someone deletes
/// the entry by hand.
#[tokio::test]
async fn a_publication_replaces_an_entry_filed_under_an_impossible_generation() {
    let server = RedisServer::start();
    let reg = registry(&server).await;
    let spec = "fixed-window:limit=7,window=1h,generation=9,transition=carry";
    for prefix in [
        "99999999999999999999".to_owned(),
        (MAX_EXACT + 1).to_string(),
        u64::MAX.to_string(),
    ] {
        hset(&server, b"api", format!("{prefix} {spec}").as_bytes());
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
        b"api",
        format!("{MAX_EXACT} {}", policy(MAX_EXACT).to_spec()).as_bytes(),
    );
    assert_eq!(reg.get("api").await.unwrap(), Some(policy(MAX_EXACT)));
    let got = reg.publish("api", &policy(2)).await;
    assert!(
        matches!(got, Err(RegistryError::Stale { stored, offered: 2, .. }) if stored == MAX_EXACT),
        "{got:?}"
    );
}
