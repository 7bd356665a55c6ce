//! The client's IP address behind reverse proxies. `X-Forwarded-For` and `Forwarded` are
//! written by whoever sent the request, so they are believed only from peers listed as
//! trusted proxies; everyone else is identified by the TCP peer address.
//!
//! ```
//! use std::net::IpAddr;
//! use axum::http::HeaderMap;
//! use tollgate_http::{ForwardedHeader, TrustedProxies};
//!
//! let proxies = TrustedProxies::new(["10.0.0.0/8".parse().unwrap()], ForwardedHeader::XForwardedFor);
//! let mut headers = HeaderMap::new();
//! headers.insert("x-forwarded-for", "6.6.6.6, 203.0.113.7, 10.0.0.2".parse().unwrap());
//! // From a trusted proxy: walk right to left past trusted hops.
//! let peer: IpAddr = "10.0.0.1".parse().unwrap();
//! assert_eq!(proxies.client_ip(peer, &headers), "203.0.113.7".parse::<IpAddr>().unwrap());
//! // From anyone else: the header is ignored.
//! let peer: IpAddr = "198.51.100.9".parse().unwrap();
//! assert_eq!(proxies.client_ip(peer, &headers), peer);
//! ```

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request, StatusCode};

use crate::key::{KeyExtractor, Rejection};

/// Why a CIDR block could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid CIDR block {0:?}: expected ADDRESS/PREFIX, e.g. 10.0.0.0/8 or fd00::/8")]
pub struct CidrError(String);

/// A block of addresses, `10.0.0.0/8` or `fd00::/8`. A bare address is a block of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Whether `ip` is inside the block. IPv4-mapped IPv6 addresses (`::ffff:10.0.0.1`) are
    /// compared as the IPv4 address they carry.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.network, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || CidrError(s.to_owned());
        let (addr, prefix) = match s.trim().split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s.trim(), None),
        };
        let written = addr.parse::<IpAddr>().map_err(|_| bad())?;
        let network = written.to_canonical();
        // An IPv4-mapped block (`::ffff:10.0.0.0/104`) is written in IPv6 terms: its prefix
        // counts the 96 bits of the mapping, and one shorter than that is not a block of
        // IPv4 addresses at all.
        let (max, mapped_bits) = match (written, network) {
            (IpAddr::V6(_), IpAddr::V4(_)) => (128, 96),
            (_, IpAddr::V4(_)) => (32, 0),
            (_, IpAddr::V6(_)) => (128, 0),
        };
        let prefix = match prefix {
            Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => p
                .parse::<u8>()
                .ok()
                .filter(|p| (mapped_bits..=max).contains(p))
                .ok_or_else(bad)?,
            Some(_) => return Err(bad()),
            None => max,
        };
        Ok(Self {
            network,
            prefix: prefix - mapped_bits,
        })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

/// Which header a trusted proxy writes the client chain into. Choose the one your proxies
/// append to: reading the other would believe whatever the client put there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (de facto standard).
    #[default]
    XForwardedFor,
    /// `Forwarded: for=client, for=proxy1` (RFC 7239).
    Forwarded,
}

/// The proxies whose forwarding headers are believed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies {
    nets: Vec<Cidr>,
    header: ForwardedHeader,
}

impl TrustedProxies {
    /// Trust no proxy: the client is always the TCP peer.
    pub fn none() -> Self {
        Self::default()
    }

    /// Trust peers inside `nets`, reading `header`.
    pub fn new(nets: impl IntoIterator<Item = Cidr>, header: ForwardedHeader) -> Self {
        Self {
            nets: nets.into_iter().collect(),
            header,
        }
    }

    /// The trusted blocks.
    pub fn nets(&self) -> &[Cidr] {
        &self.nets
    }

    /// The header read from trusted peers.
    pub fn header(&self) -> ForwardedHeader {
        self.header
    }

    /// Whether `ip` is a trusted proxy.
    pub fn is_trusted(&self, ip: IpAddr) -> bool {
        self.nets.iter().any(|net| net.contains(ip))
    }

    /// The client address of a request that arrived from `peer` with `headers`.
    ///
    /// If `peer` is not trusted, it is the client. Otherwise the forwarding chain is walked
    /// from the right (the hop nearest to us, across repeated header lines) past trusted
    /// proxies; the first untrusted address is the client. An entry that is not an address
    /// (`unknown`, an obfuscated `_node`, garbage, bytes that are not text) stops the walk at
    /// the last trusted hop, since nothing left of it can be believed. If every hop is
    /// trusted, the leftmost one is the client.
    ///
    /// Empty entries are skipped, as lists allow them (RFC 9110 §5.6.1).
    ///
    /// Each line is cut into entries from the right and only as far as the walk goes, so what
    /// a client wrote at the left of a line a proxy appended to can neither hide nor alter the
    /// entries to its right: an `X-Forwarded-For` line is cut at every comma (the syntax has
    /// no quoting), a `Forwarded` line at the commas outside quoted strings (RFC 7239), found
    /// from the right so that a quote the client left open spoils only its own element.
    pub fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = peer.to_canonical();
        if !self.is_trusted(peer) {
            return peer;
        }
        let name = match self.header {
            ForwardedHeader::XForwardedFor => "x-forwarded-for",
            ForwardedHeader::Forwarded => "forwarded",
        };
        let mut client = peer;
        for line in headers.get_all(name).iter().rev() {
            let line = line.as_bytes();
            let settled = match self.header {
                ForwardedHeader::XForwardedFor => self.walk(
                    &mut client,
                    line.rsplit(|&b| b == b',')
                        .filter(|entry| !entry.trim_ascii().is_empty())
                        .map(|entry| parse_node(std::str::from_utf8(entry).ok()?)),
                ),
                ForwardedHeader::Forwarded => self.walk(
                    &mut client,
                    ForwardedElements::new(line)
                        .filter(|element| element.is_none_or(|e| !e.trim_ascii().is_empty()))
                        .map(|element| forwarded_for(element?)),
                ),
            };
            if settled {
                return client;
            }
        }
        client
    }

    /// Walks `hops` (right to left) from `client`, the last trusted hop so far: true once
    /// the client is settled (an untrusted address, or an entry that is not one).
    fn walk(&self, client: &mut IpAddr, hops: impl Iterator<Item = Option<IpAddr>>) -> bool {
        for hop in hops {
            let Some(ip) = hop else {
                return true;
            };
            *client = ip;
            if !self.is_trusted(ip) {
                return true;
            }
        }
        false
    }
}

/// The elements of one `Forwarded` line, right to left: the line cut at each comma outside a
/// quoted string (RFC 9110 §5.6.4: `"` opens and closes one, a backslash inside escapes the
/// next byte). Scanning from the right, the first `"` met closes a string and the string
/// opens at the next `"` not escaped; a string still open at the start of the line leaves
/// its element `None`.
struct ForwardedElements<'a> {
    /// What is left to cut, at the left of the elements already given.
    rest: Option<&'a [u8]>,
}

impl<'a> ForwardedElements<'a> {
    fn new(line: &'a [u8]) -> Self {
        Self { rest: Some(line) }
    }
}

impl<'a> Iterator for ForwardedElements<'a> {
    type Item = Option<&'a [u8]>;

    fn next(&mut self) -> Option<Self::Item> {
        let line = self.rest?;
        let mut quoted = false;
        for i in (0..line.len()).rev() {
            match line[i] {
                b'"' if !quoted => quoted = true,
                b'"' => {
                    let escapes = line[..i].iter().rev().take_while(|&&b| b == b'\\').count();
                    quoted = escapes % 2 == 1;
                }
                b',' if !quoted => {
                    self.rest = Some(&line[..i]);
                    return Some(Some(&line[i + 1..]));
                }
                _ => {}
            }
        }
        self.rest = None;
        Some((!quoted).then_some(line))
    }
}

/// Cuts `text` at each `sep` outside a quoted string (as [`ForwardedElements`], from the
/// left); `None` if a string is left open.
fn split_outside_quotes(text: &[u8], sep: u8) -> Option<Vec<&[u8]>> {
    let (mut parts, mut from, mut quoted, mut escaped) = (Vec::new(), 0, false, false);
    for (i, &b) in text.iter().enumerate() {
        if quoted {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => quoted = false,
                _ => {}
            }
        } else if b == b'"' {
            quoted = true;
        } else if b == sep {
            parts.push(&text[from..i]);
            from = i + 1;
        }
    }
    if quoted {
        return None;
    }
    parts.push(&text[from..]);
    Some(parts)
}

/// The `for=` node of one `Forwarded` element; `None` if absent, not an address, or if the
/// element is malformed (a string left open, a quoted value with text around it, bytes that
/// are not text).
fn forwarded_for(element: &[u8]) -> Option<IpAddr> {
    let mut node = None;
    for pair in split_outside_quotes(element, b';')? {
        let pair = std::str::from_utf8(pair).ok()?;
        if pair.trim().is_empty() {
            continue; // `for=192.0.2.1;` (RFC 7239: pairs may be empty)
        }
        let (name, value) = pair.split_once('=')?;
        let value = value.trim();
        let value = match value.strip_prefix('"') {
            Some(quoted) => unescape(quoted.strip_suffix('"')?)?,
            None if value.contains('"') => return None,
            None => value.to_owned(),
        };
        if name.trim().eq_ignore_ascii_case("for") && node.is_none() {
            node = Some(value);
        }
    }
    parse_node(&node?)
}

/// The text of a quoted string's inside: `\x` is `x`; `None` for an unescaped `"`.
fn unescape(inside: &str) -> Option<String> {
    let mut out = String::with_capacity(inside.len());
    let mut chars = inside.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.push(chars.next()?),
            '"' => return None,
            c => out.push(c),
        }
    }
    Some(out)
}

/// An address as proxies write it: `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`, `[2001:db8::1]`,
/// `[2001:db8::1]:80`, optionally quoted; the port may be obfuscated (RFC 7239 `obfport`,
/// `1.2.3.4:_p1`, `[2001:db8::1]:_p1`), which leaves the address as it is.
fn parse_node(text: &str) -> Option<IpAddr> {
    let text = text.trim().trim_matches('"');
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    if let Ok(sa) = text.parse::<SocketAddr>() {
        return Some(sa.ip().to_canonical());
    }
    let text = match text.rsplit_once(':') {
        Some((host, port)) if is_obfport(port) => {
            // An IPv6 address with a port is bracketed; an unbracketed one is the address.
            match host.strip_prefix('[') {
                Some(_) => host,
                None => return host.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4),
            }
        }
        _ => text,
    };
    let inner = text.strip_prefix('[')?.strip_suffix(']')?;
    inner.parse::<IpAddr>().ok().map(|ip| ip.to_canonical())
}

/// RFC 7239 `obfport`: `_` then one or more of ALPHA, DIGIT, `.`, `_`, `-`.
fn is_obfport(port: &str) -> bool {
    port.strip_prefix('_').is_some_and(|rest| {
        !rest.is_empty()
            && rest
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    })
}

/// Why a [`ClientIpKey`] prefix length was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{family} prefix length must be 0 to {max}, got {len}")]
pub struct PrefixLenError {
    /// `"IPv4"` or `"IPv6"`.
    pub family: &'static str,
    /// The length asked for.
    pub len: u8,
    /// The largest valid length (32 or 128).
    pub max: u8,
}

/// Keys a request by its client IP address: the TCP peer (axum's
/// [`ConnectInfo<SocketAddr>`](ConnectInfo)), or the forwarded client when the peer is a
/// [trusted proxy](TrustedProxies).
///
/// Addresses are grouped into networks before they become a key, because one client
/// commonly holds many addresses: an IPv6 client is usually given a whole `/64` (and picks a
/// new address in it at will), so keying by the full address would hand it 2^64 buckets. By
/// default every IPv6 address in one `/64` shares a bucket ([`ClientIpKey::ipv6_prefix`]
/// changes the length; `128` keys each address) and each IPv4 address has its own
/// ([`ClientIpKey::ipv4_prefix`], default `32`). An IPv4-mapped IPv6 address
/// (`::ffff:192.0.2.1`, as a dual-stack listener reports IPv4 peers) is the IPv4 address.
/// The key is the network in CIDR form (`2001:db8:1:2::/64`), or the bare address for a
/// full-length prefix (`192.0.2.1`).
///
/// Serve the app with `into_make_service_with_connect_info::<SocketAddr>()` so the peer
/// address is known; without it every request is refused with 500, since keying everyone
/// under one bucket would be worse.
///
/// ```
/// use std::net::SocketAddr;
/// use axum::{extract::ConnectInfo, http::Request};
/// use tollgate_http::{ClientIpKey, KeyExtractor, TrustedProxies};
///
/// let key = ClientIpKey::new(TrustedProxies::none());
/// let request = |peer: &str| {
///     let mut req = Request::new(());
///     req.extensions_mut().insert(ConnectInfo(peer.parse::<SocketAddr>().unwrap()));
///     req
/// };
/// assert_eq!(key.extract(&request("192.0.2.1:5000")).unwrap(), b"192.0.2.1");
/// assert_eq!(key.extract(&request("[::ffff:192.0.2.1]:5000")).unwrap(), b"192.0.2.1");
/// assert_eq!(key.extract(&request("[2001:db8:1:2::beef]:443")).unwrap(), b"2001:db8:1:2::/64");
/// let per_address = ClientIpKey::new(TrustedProxies::none()).ipv6_prefix(128).unwrap();
/// assert_eq!(per_address.extract(&request("[2001:db8:1:2::beef]:443")).unwrap(), b"2001:db8:1:2::beef");
/// ```
#[derive(Debug, Clone)]
pub struct ClientIpKey {
    proxies: std::sync::Arc<TrustedProxies>,
    ipv4_prefix: u8,
    ipv6_prefix: u8,
}

impl Default for ClientIpKey {
    fn default() -> Self {
        Self::new(TrustedProxies::none())
    }
}

impl ClientIpKey {
    /// The default IPv6 grouping: one bucket per `/64`.
    pub const DEFAULT_IPV6_PREFIX: u8 = 64;
    /// The default IPv4 grouping: one bucket per address.
    pub const DEFAULT_IPV4_PREFIX: u8 = 32;

    /// Keys by client IP, believing forwarding headers only from `proxies`; IPv6 addresses
    /// grouped by `/64`, IPv4 addresses one by one.
    pub fn new(proxies: TrustedProxies) -> Self {
        Self {
            proxies: std::sync::Arc::new(proxies),
            ipv4_prefix: Self::DEFAULT_IPV4_PREFIX,
            ipv6_prefix: Self::DEFAULT_IPV6_PREFIX,
        }
    }

    /// Groups IPv6 clients by their first `len` bits (0 to 128; default 64): every address
    /// in one `/len` network shares a bucket. `128` keys each address on its own; a shorter
    /// prefix (`/56`, `/48`) suits networks that hand clients larger blocks.
    pub fn ipv6_prefix(mut self, len: u8) -> Result<Self, PrefixLenError> {
        if len > 128 {
            return Err(PrefixLenError {
                family: "IPv6",
                len,
                max: 128,
            });
        }
        self.ipv6_prefix = len;
        Ok(self)
    }

    /// Groups IPv4 clients by their first `len` bits (0 to 32; default 32, one bucket per
    /// address).
    pub fn ipv4_prefix(mut self, len: u8) -> Result<Self, PrefixLenError> {
        if len > 32 {
            return Err(PrefixLenError {
                family: "IPv4",
                len,
                max: 32,
            });
        }
        self.ipv4_prefix = len;
        Ok(self)
    }

    /// The IPv4 and IPv6 prefix lengths clients are grouped by.
    pub fn prefixes(&self) -> (u8, u8) {
        (self.ipv4_prefix, self.ipv6_prefix)
    }

    /// The client address of `request`, if its peer address is known.
    pub fn client_ip<B>(&self, request: &Request<B>) -> Option<IpAddr> {
        let ConnectInfo(peer) = request.extensions().get::<ConnectInfo<SocketAddr>>()?;
        Some(self.proxies.client_ip(peer.ip(), request.headers()))
    }

    /// The network `ip` is grouped into (IPv4-mapped IPv6 addresses count as IPv4).
    pub fn network(&self, ip: IpAddr) -> Cidr {
        match ip.to_canonical() {
            IpAddr::V4(v4) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.ipv4_prefix))
                    .unwrap_or(0);
                Cidr {
                    network: IpAddr::V4((u32::from(v4) & mask).into()),
                    prefix: self.ipv4_prefix,
                }
            }
            IpAddr::V6(v6) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.ipv6_prefix))
                    .unwrap_or(0);
                Cidr {
                    network: IpAddr::V6((u128::from(v6) & mask).into()),
                    prefix: self.ipv6_prefix,
                }
            }
        }
    }

    /// The bucket identity of `ip`: its network in CIDR form, or the bare address when the
    /// prefix is full length.
    fn bucket(&self, ip: IpAddr) -> String {
        let net = self.network(ip);
        let full = if net.network.is_ipv4() { 32 } else { 128 };
        if net.prefix == full {
            net.network.to_string()
        } else {
            net.to_string()
        }
    }
}

impl KeyExtractor for ClientIpKey {
    fn extract<B>(&self, request: &Request<B>) -> Result<Vec<u8>, Rejection> {
        self.client_ip(request)
            .map(|ip| self.bucket(ip).into_bytes())
            .ok_or_else(|| {
                Rejection::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "client address unknown (serve with ConnectInfo<SocketAddr>)",
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn headers(name: &str, values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(
                axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn xff_trusting(nets: &[&str]) -> TrustedProxies {
        TrustedProxies::new(
            nets.iter().map(|n| n.parse().unwrap()),
            ForwardedHeader::XForwardedFor,
        )
    }

    #[test]
    fn cidr_blocks_match_by_prefix() {
        let net: Cidr = "10.1.0.0/16".parse().unwrap();
        assert!(net.contains(ip("10.1.255.3")));
        assert!(!net.contains(ip("10.2.0.1")));
        assert!(net.contains(ip("::ffff:10.1.0.9")), "IPv4-mapped IPv6");
        assert!(!net.contains(ip("2001:db8::1")));
        let v6: Cidr = "2001:db8::/32".parse().unwrap();
        assert!(v6.contains(ip("2001:db8:ffff::1")));
        assert!(!v6.contains(ip("2001:db9::1")));
        // an IPv4-mapped block is the IPv4 block it maps (peers are compared as IPv4)
        let mapped: Cidr = "::ffff:10.0.0.0/104".parse().unwrap();
        assert_eq!(mapped, "10.0.0.0/8".parse().unwrap());
        assert!(mapped.contains(ip("10.9.8.7")) && mapped.contains(ip("::ffff:10.9.8.7")));
        assert_eq!(
            "::ffff:10.1.2.3".parse::<Cidr>().unwrap().to_string(),
            "10.1.2.3/32"
        );
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("203.0.113.1")));
        let one: Cidr = "192.0.2.7".parse().unwrap();
        assert_eq!(one.to_string(), "192.0.2.7/32");
        assert!(one.contains(ip("192.0.2.7")) && !one.contains(ip("192.0.2.8")));
        for bad in [
            "10.0.0.0/33",
            "::/129",
            "10.0.0/8",
            "host/8",
            "10.0.0.0/-1",
            "10.0.0.0/+8",
            "10.0.0.0/",
            "10.0.0.0/ 8",
            "::ffff:10.0.0.0/95",
            "",
        ] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn untrusted_peer_is_the_client_whatever_it_forwards() {
        let p = xff_trusting(&["10.0.0.0/8"]);
        let h = headers("x-forwarded-for", &["1.1.1.1"]);
        assert_eq!(p.client_ip(ip("203.0.113.5"), &h), ip("203.0.113.5"));
        assert_eq!(
            TrustedProxies::none().client_ip(ip("10.0.0.1"), &h),
            ip("10.0.0.1")
        );
    }

    #[test]
    fn walks_right_to_left_past_trusted_hops() {
        let p = xff_trusting(&["10.0.0.0/8", "192.168.0.0/16"]);
        // The client forged "6.6.6.6"; the first proxy appended the real client address.
        let h = headers("x-forwarded-for", &["6.6.6.6, 198.51.100.4, 192.168.1.1"]);
        assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("198.51.100.4"));
        // Repeated header lines are one list, in order.
        let h = headers("x-forwarded-for", &["6.6.6.6, 198.51.100.4", "192.168.1.1"]);
        assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("198.51.100.4"));
    }

    #[test]
    fn a_trusted_peer_without_the_header_is_the_client() {
        let p = xff_trusting(&["10.0.0.0/8"]);
        assert_eq!(
            p.client_ip(ip("10.0.0.1"), &HeaderMap::new()),
            ip("10.0.0.1")
        );
    }

    #[test]
    fn all_trusted_hops_yield_the_leftmost() {
        let p = xff_trusting(&["10.0.0.0/8"]);
        let h = headers("x-forwarded-for", &["10.9.9.9, 10.1.1.1"]);
        assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("10.9.9.9"));
    }

    #[test]
    fn garbage_stops_the_walk_at_the_last_trusted_hop() {
        let p = xff_trusting(&["10.0.0.0/8"]);
        let h = headers("x-forwarded-for", &["1.2.3.4, unknown, 10.0.0.7"]);
        assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("10.0.0.7"));
        let h = headers("x-forwarded-for", &["1.2.3.4, not-an-ip"]);
        assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("10.0.0.1"));
    }

    #[test]
    fn ports_brackets_and_mapped_addresses_are_understood() {
        let p = xff_trusting(&["10.0.0.0/8"]);
        for (value, want) in [
            ("198.51.100.4:5555", "198.51.100.4"),
            ("[2001:db8::1]:443", "2001:db8::1"),
            ("[2001:db8::1]", "2001:db8::1"),
            ("2001:db8::1", "2001:db8::1"),
            ("::ffff:198.51.100.4", "198.51.100.4"),
        ] {
            let h = headers("x-forwarded-for", &[value]);
            assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip(want), "{value}");
        }
        // A trusted peer seen over IPv6 as an IPv4-mapped address.
        let h = headers("x-forwarded-for", &["198.51.100.4"]);
        assert_eq!(p.client_ip(ip("::ffff:10.0.0.1"), &h), ip("198.51.100.4"));
    }

    #[test]
    fn forwarded_header_reads_for_parameters() {
        let p = TrustedProxies::new(["10.0.0.0/8".parse().unwrap()], ForwardedHeader::Forwarded);
        let h = headers(
            "forwarded",
            &[
                r#"for=6.6.6.6, For="[2001:db8:cafe::17]:4711";proto=https, for=10.0.0.3;by=10.0.0.1"#,
            ],
        );
        assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("2001:db8:cafe::17"));
        let h = headers("forwarded", &["for=198.51.100.2;proto=http"]);
        assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("198.51.100.2"));
        // Obfuscated or unknown nodes stop the walk.
        let h = headers("forwarded", &["for=1.2.3.4, for=_hidden"]);
        assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("10.0.0.1"));
    }

    fn forwarded_trusting_10() -> TrustedProxies {
        TrustedProxies::new(["10.0.0.0/8".parse().unwrap()], ForwardedHeader::Forwarded)
    }

    fn raw(name: &'static str, line: &[u8]) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(name, HeaderValue::from_bytes(line).unwrap());
        h
    }

    /// A proxy appends the real peer to the client's line (nginx's
    /// `$proxy_add_x_forwarded_for`); one byte that is not text at the client's end hid it
    /// (the whole line counted as one unreadable hop), keying the client as the proxy.
    #[test]
    fn bytes_that_are_not_text_spoil_only_their_own_entry() {
        let p = xff_trusting(&["10.0.0.0/8"]);
        let h = raw("x-forwarded-for", b"\xff, 203.0.113.7");
        assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("203.0.113.7"));
        let h = raw("x-forwarded-for", b"203.0.113.7, \xff, 10.0.0.2");
        assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("10.0.0.2"));
        let h = raw("forwarded", b"for=\"\xff\", for=203.0.113.7");
        assert_eq!(
            forwarded_trusting_10().client_ip(ip("10.0.0.1"), &h),
            ip("203.0.113.7")
        );
    }

    /// RFC 7239: a value may be a quoted string holding `,` and `;`; they separate nothing
    /// there. Split on them anyway, a proxy's quoted parameter the client influences (a
    /// `host`) planted a `for=` of the client's choosing.
    #[test]
    fn forwarded_separators_inside_quoted_strings_separate_nothing() {
        let p = forwarded_trusting_10();
        for line in [
            r#"for=203.0.113.7;host="x,for=6.6.6.6""#,
            r#"host="x;for=6.6.6.6";for=203.0.113.7"#,
            r#"for=203.0.113.7;host="x\",for=6.6.6.6""#,
            r#"for=1.1.1.1, for=203.0.113.7;host="a\"b;for=6.6.6.6,for=7.7.7.7""#,
        ] {
            let h = headers("forwarded", &[line]);
            assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("203.0.113.7"), "{line}");
        }
        // quoted nodes, escapes undone
        let h = headers("forwarded", &[r#"for="198.51.100.\2""#]);
        assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("198.51.100.2"));
    }

    /// A quote the client leaves open spoils its own element only, not the one a proxy
    /// appended after it; a malformed element stops the walk like any other non-address.
    #[test]
    fn an_open_quote_spoils_only_its_own_forwarded_element() {
        let p = forwarded_trusting_10();
        for (line, want) in [
            (r#"for="6.6.6.6, for=203.0.113.7"#, "203.0.113.7"),
            (r#"for=6.6.6.6", for=203.0.113.7"#, "203.0.113.7"),
            (r#"for=6.6.6.6;host="x, for=10.0.0.5"#, "10.0.0.5"),
            (r#"for="6.6.6.6"x, for=10.0.0.5"#, "10.0.0.5"),
            (r#"for=6"6.6.6.6", for=10.0.0.5"#, "10.0.0.5"),
        ] {
            let h = headers("forwarded", &[line]);
            assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip(want), "{line}");
        }
        // across lines: the last line is nearest
        let h = headers("forwarded", &[r#"for="6.6.6.6"#, "for=203.0.113.7"]);
        assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("203.0.113.7"));
    }

    /// Lists may hold empty elements and elements empty pairs; a recipient ignores them
    /// (RFC 9110 §5.6.1, RFC 7239 §4).
    #[test]
    fn empty_list_elements_and_pairs_are_skipped() {
        let p = forwarded_trusting_10();
        for line in [
            "for=203.0.113.7;, for=10.0.0.5",
            "for=203.0.113.7;;proto=https, , for=10.0.0.5",
            ";for=203.0.113.7, for=10.0.0.5,",
        ] {
            let h = headers("forwarded", &[line]);
            assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("203.0.113.7"), "{line}");
        }
        let h = headers("x-forwarded-for", &["203.0.113.7, , 10.0.0.5,"]);
        assert_eq!(
            xff_trusting(&["10.0.0.0/8"]).client_ip(ip("10.0.0.1"), &h),
            ip("203.0.113.7")
        );
    }

    /// Whatever a client writes at the left of a line (quotes left open, escapes, separators,
    /// bytes that are not text, trusted-looking addresses), the entries a trusted proxy
    /// appended after it decide the client: a deterministic sweep of 30,000 random prefixes
    /// per header form, on one line and on a line of its own before the proxy's.
    #[test]
    fn nothing_a_client_writes_first_changes_what_a_proxy_appended() {
        let mut state: u64 = 0x1234_5678_9abc_def1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let alphabet: &[u8] = b"\",;=\\ []:._-forFOR01256789abcdefunknown\t\xff\xfe";
        for (header, name, appended) in [
            (
                ForwardedHeader::XForwardedFor,
                "x-forwarded-for",
                "203.0.113.7",
            ),
            (
                ForwardedHeader::XForwardedFor,
                "x-forwarded-for",
                "203.0.113.7, 10.0.0.2",
            ),
            (ForwardedHeader::Forwarded, "forwarded", "for=203.0.113.7"),
            (
                ForwardedHeader::Forwarded,
                "forwarded",
                r#"for="203.0.113.7";host="a,b\"c;for=6.6.6.6", for=10.0.0.2"#,
            ),
        ] {
            let proxies = TrustedProxies::new(["10.0.0.0/8".parse().unwrap()], header);
            for i in 0..30_000 {
                let len = usize::try_from(next() % 24).unwrap();
                let written: Vec<u8> = (0..len)
                    .map(|_| alphabet[usize::try_from(next()).unwrap() % alphabet.len()])
                    .collect();
                let Ok(own_line) = HeaderValue::from_bytes(&written) else {
                    continue;
                };
                let mut h = HeaderMap::new();
                if i % 2 == 0 {
                    let mut line = written.clone();
                    line.extend_from_slice(b", ");
                    line.extend_from_slice(appended.as_bytes());
                    h.insert(name, HeaderValue::from_bytes(&line).unwrap());
                } else {
                    h.append(name, own_line);
                    h.append(name, HeaderValue::from_static(appended));
                }
                assert_eq!(
                    proxies.client_ip(ip("10.0.0.1"), &h),
                    ip("203.0.113.7"),
                    "{h:?}"
                );
            }
        }
    }

    #[test]
    fn only_the_configured_header_is_read() {
        let p = xff_trusting(&["10.0.0.0/8"]);
        let h = headers("forwarded", &["for=1.2.3.4"]);
        assert_eq!(p.client_ip(ip("10.0.0.1"), &h), ip("10.0.0.1"));
    }
}
