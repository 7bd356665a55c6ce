//! Draws `docs/algorithms.svg`: how the token bucket, the fixed window and the sliding log
//! admit the same traffic — a burst just before a window boundary, another just after it,
//! then steady traffic above the rate — each "10 per 10 s".
//!
//! Every dot is a real decision of a real [`Limiter`] on a [`LocalStore`] whose
//! [`ManualClock`] the example moves from request to request.
//!
//! ```sh
//! cargo run -p tollgate-http --example algorithms_svg > docs/algorithms.svg
//! ```

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use tollgate::{FailureMode, Limiter, LocalStore, ManualClock, Policy, Rate};

/// An instant on a 10-second boundary, so fixed windows start at t = 0, 10 s, 20 s.
const T0_MICROS: u64 = 1_700_000_000_000_000;
const SPAN_MS: u64 = 30_000;
const COLUMN_MS: u64 = 250;

const WIDTH: u64 = 960;
const LEFT: u64 = 170;
const RIGHT: u64 = 40;
const PANEL: u64 = 170;
const TOP: u64 = 70;
const DOT: u64 = 7;

/// The offered traffic, in ms from t = 0: 15 requests at 9 s, 15 at 10 s, then 2 per second.
fn traffic() -> Vec<u64> {
    let mut at: Vec<u64> = (0..15).map(|i| 9_000 + i * 10).collect();
    at.extend((0..15).map(|i| 10_000 + i * 10));
    at.extend((11_000..SPAN_MS).step_by(500));
    at
}

struct Lane {
    title: &'static str,
    spec: &'static str,
    note: &'static str,
    policy: Policy,
    decisions: Vec<(u64, bool)>,
}

async fn run(policy: Policy, at: &[u64]) -> Vec<(u64, bool)> {
    let clock = ManualClock::new(T0_MICROS);
    let limiter = Limiter::builder("demo", policy)
        .store(Arc::new(LocalStore::with_clock(clock.clone())))
        .failure_mode(FailureMode::Closed)
        .build()
        .expect("a complete limiter");
    let mut out = Vec::with_capacity(at.len());
    for &ms in at {
        clock.set(T0_MICROS + ms * 1_000);
        let decision = limiter.check(["client"], 1).await.expect("a decision");
        out.push((ms, decision.allowed));
    }
    out
}

/// The most requests admitted in any 10-second interval.
fn busiest_10s(decisions: &[(u64, bool)]) -> usize {
    let admitted: Vec<u64> = decisions.iter().filter(|d| d.1).map(|d| d.0).collect();
    admitted
        .iter()
        .map(|&start| {
            admitted
                .iter()
                .filter(|&&t| t >= start && t < start + 10_000)
                .count()
        })
        .max()
        .unwrap_or(0)
}

fn x_of(ms: u64) -> u64 {
    LEFT + ms * (WIDTH - LEFT - RIGHT) / SPAN_MS
}

fn render(lanes: &[Lane]) -> String {
    let height = TOP + PANEL * lanes.len() as u64 + 50;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="13">"#
    );
    let _ = writeln!(s, r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="24" font-size="16" font-weight="bold">Same traffic, three algorithms, each "10 per 10 s"</text>"#
    );
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="44" fill="#444">15 requests at 9 s, 15 at 10 s (across a fixed-window boundary), then 2 per second. <tspan fill="#1a7f37">●</tspan> admitted  <tspan fill="#cf222e">●</tspan> denied (429)</text>"##
    );
    let bottom = TOP + PANEL * lanes.len() as u64;
    // Fixed-window boundaries and the time axis.
    for sec in (0..=SPAN_MS / 1000).step_by(5) {
        let x = x_of(sec * 1000);
        let (stroke, dash) = if sec % 10 == 0 {
            ("#888", r#" stroke-dasharray="4 3""#)
        } else {
            ("#ddd", "")
        };
        let _ = writeln!(
            s,
            r#"<line x1="{x}" y1="{TOP}" x2="{x}" y2="{bottom}" stroke="{stroke}"{dash}/>"#
        );
        let _ = writeln!(
            s,
            r##"<text x="{x}" y="{}" text-anchor="middle" fill="#444">{sec} s</text>"##,
            bottom + 18
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" text-anchor="middle" fill="#888">dashed: fixed-window boundaries</text>"##,
        x_of(SPAN_MS / 2),
        bottom + 38
    );
    for (i, lane) in lanes.iter().enumerate() {
        render_lane(&mut s, lane, TOP + PANEL * i as u64);
    }
    s.push_str("</svg>\n");
    s
}

/// One lane: its labels, and a dot per request, stacked per 250 ms column.
fn render_lane(s: &mut String, lane: &Lane, top: u64) {
    let base = top + PANEL - 18;
    let admitted = lane.decisions.iter().filter(|d| d.1).count();
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{base}" x2="{}" y2="{base}" stroke="#bbb"/>"##,
        WIDTH - RIGHT
    );
    let _ = writeln!(
        s,
        r#"<text x="12" y="{}" font-weight="bold">{}</text>"#,
        top + 30,
        lane.title
    );
    let _ = writeln!(
        s,
        r##"<text x="12" y="{}" fill="#444" font-size="11">{}</text>"##,
        top + 48,
        lane.spec
    );
    let _ = writeln!(
        s,
        r##"<text x="12" y="{}" fill="#444">admitted {admitted} of {}</text>"##,
        top + 72,
        lane.decisions.len()
    );
    let _ = writeln!(
        s,
        r##"<text x="12" y="{}" fill="#444">busiest 10 s: {}</text>"##,
        top + 90,
        busiest_10s(&lane.decisions)
    );
    let _ = writeln!(
        s,
        r##"<text x="12" y="{}" fill="#888" font-size="11">limit {}</text>"##,
        top + 106,
        lane.policy.limit()
    );
    let _ = writeln!(
        s,
        r##"<text x="12" y="{}" fill="#0550ae" font-size="11">{}</text>"##,
        top + 126,
        lane.note
    );
    // Requests in the same 250 ms column stack upwards, admitted first.
    let mut column = u64::MAX;
    let mut height = 0;
    let mut sorted = lane.decisions.clone();
    sorted.sort_by_key(|&(ms, allowed)| (ms / COLUMN_MS, !allowed, ms));
    for (ms, allowed) in sorted {
        if ms / COLUMN_MS != column {
            column = ms / COLUMN_MS;
            height = 0;
        }
        let cx = x_of(column * COLUMN_MS + COLUMN_MS / 2);
        let cy = base - 6 - height * DOT;
        height += 1;
        let fill = if allowed { "#1a7f37" } else { "#cf222e" };
        let _ = writeln!(
            s,
            r#"<circle cx="{cx}" cy="{cy}" r="3" fill="{fill}"><title>t={:.2} s {}</title></circle>"#,
            ms as f64 / 1000.0,
            if allowed { "admitted" } else { "denied" }
        );
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let at = traffic();
    let mut lanes = vec![
        Lane {
            title: "Token bucket",
            spec: "capacity=10, rate=1/s",
            note: "a burst of 10, then 1 per second",
            policy: Policy::token_bucket(10, Rate::per_second(1)).expect("valid"),
            decisions: Vec::new(),
        },
        Lane {
            title: "Fixed window",
            spec: "limit=10, window=10s",
            note: "10 before the boundary, 10 after it",
            policy: Policy::fixed_window(10, Duration::from_secs(10)).expect("valid"),
            decisions: Vec::new(),
        },
        Lane {
            title: "Sliding log",
            spec: "limit=10, window=10s",
            note: "never more than 10 in any 10 s",
            policy: Policy::sliding_log(10, Duration::from_secs(10)).expect("valid"),
            decisions: Vec::new(),
        },
    ];
    for lane in &mut lanes {
        lane.decisions = run(lane.policy, &at).await;
        eprintln!(
            "{:<13} admitted {:>2} of {}, busiest 10 s: {}",
            lane.title,
            lane.decisions.iter().filter(|d| d.1).count(),
            at.len(),
            busiest_10s(&lane.decisions)
        );
    }
    print!("{}", render(&lanes));
}
