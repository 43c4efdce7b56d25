//! Which requests the gateway takes: at most `--max-concurrent-requests`
//! at once, shared fairly among the clients that want them.
//!
//! A client is a tenant where API keys are required, else an address (an
//! IPv4 address, an IPv6 /64). While more than a quarter of the places
//! are free every client is admitted. Below that, a client holding an
//! equal share of the places or more (the places over the clients holding
//! any or refused in the last few seconds) is refused, so the places that
//! free up go to the others: one client that fills the gateway cannot keep
//! it from another, whose first refusal is enough to claim its share. No
//! request is ended to make room, and a lone client may use every place.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How long a refused client counts among those wanting places: long
/// enough for a client retrying as told (`Retry-After: 1`) to keep its
/// claim.
pub const WANTING_FOR: Duration = Duration::from_secs(5);

/// Who a request counts against.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Client {
    /// A tenant, where API keys are required.
    Tenant(String),
    /// An address (IPv4, or an IPv6 /64).
    Address(IpAddr),
    /// A caller whose address is not known (one in-process caller).
    Unknown,
}

impl Client {
    /// The client calling from `address` with (or without) a key's tenant.
    pub fn of(tenant: Option<&str>, address: Option<IpAddr>) -> Self {
        match (tenant, address) {
            (Some(tenant), _) => Self::Tenant(tenant.to_owned()),
            (None, Some(address)) => Self::Address(turbine_runtime::connections::client(address)),
            (None, None) => Self::Unknown,
        }
    }
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Every place is taken.
    Full,
    /// Few places are free and this client holds its share of them.
    Share {
        /// The client's share.
        share: usize,
    },
}

/// The gateway's places and who holds them.
#[derive(Debug)]
pub struct Admission {
    capacity: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    held: usize,
    /// Places held, by client (only clients holding some).
    holding: HashMap<Client, usize>,
    /// Clients holding none that were refused, and when last: each counts
    /// as wanting places for [`WANTING_FOR`].
    wanting: HashMap<Client, Instant>,
    pruned_at: Option<Instant>,
}

impl State {
    fn prune(&mut self, now: Instant) {
        if self.pruned_at.is_some_and(|at| now.saturating_duration_since(at) < Duration::from_millis(100)) {
            return;
        }
        self.pruned_at = Some(now);
        self.wanting.retain(|_, at| now.saturating_duration_since(*at) < WANTING_FOR);
    }
}

/// One admitted request's place, given back when dropped.
#[derive(Debug)]
pub struct Place {
    admission: Arc<Admission>,
    client: Client,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut state = self.admission.state.lock();
        state.held -= 1;
        if let Some(count) = state.holding.get_mut(&self.client) {
            *count -= 1;
            if *count == 0 {
                state.holding.remove(&self.client);
            }
        }
    }
}

impl Admission {
    /// `capacity` places, none held.
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Self { capacity, state: Mutex::new(State::default()) })
    }

    /// How many places there are (`--max-concurrent-requests`).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// A place for one more request of `client`, or why not.
    pub fn admit(self: &Arc<Self>, client: Client) -> Result<Place, Refused> {
        self.admit_at(client, Instant::now())
    }

    fn admit_at(self: &Arc<Self>, client: Client, now: Instant) -> Result<Place, Refused> {
        let mut state = self.state.lock();
        state.prune(now);
        let mine = state.holding.get(&client).copied().unwrap_or(0);
        let refused = if state.held >= self.capacity {
            Some(Refused::Full)
        } else if self.capacity - state.held <= self.capacity / 4 {
            // Few places free: the clients holding some, those wanting
            // some, and this one share them equally.
            let newcomer = usize::from(mine == 0 && !state.wanting.contains_key(&client));
            let share = (self.capacity / (state.holding.len() + state.wanting.len() + newcomer)).max(1);
            (mine >= share).then_some(Refused::Share { share })
        } else {
            None
        };
        if let Some(refused) = refused {
            // A client holding none claims its share by being refused (up
            // to one claim per place, so the claims stay bounded).
            if mine == 0 && (state.wanting.contains_key(&client) || state.wanting.len() < self.capacity) {
                state.wanting.insert(client, now);
            }
            return Err(refused);
        }
        state.wanting.remove(&client);
        state.held += 1;
        *state.holding.entry(client.clone()).or_default() += 1;
        Ok(Place { admission: self.clone(), client })
    }

    /// Places held now.
    pub fn held(&self) -> usize {
        self.state.lock().held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn address(last: u8) -> Client {
        Client::Address(IpAddr::from([10, 0, 0, last]))
    }

    fn fill(admission: &Arc<Admission>, client: &Client, now: Instant) -> Vec<Place> {
        std::iter::from_fn(|| admission.admit_at(client.clone(), now).ok()).collect()
    }

    #[test]
    fn a_lone_client_may_take_every_place() {
        let admission = Admission::new(8);
        let now = Instant::now();
        let places = fill(&admission, &address(1), now);
        assert_eq!(places.len(), 8);
        assert_eq!(admission.admit_at(address(1), now).unwrap_err(), Refused::Full);
        drop(places);
        assert_eq!(admission.held(), 0);
        assert!(admission.state.lock().holding.is_empty(), "no entry is kept for a client holding nothing");
    }

    #[test]
    fn places_that_free_up_go_to_a_client_refused_while_one_held_them_all() {
        let admission = Admission::new(8);
        let now = Instant::now();
        let (hog, other) = (address(1), address(2));
        let mut hogged = fill(&admission, &hog, now);
        assert_eq!(hogged.len(), 8);
        assert_eq!(admission.admit_at(other.clone(), now).unwrap_err(), Refused::Full, "nothing free");
        // The hog's requests end; it may not take their places again
        // while the other client wants them.
        hogged.truncate(6);
        assert_eq!(admission.admit_at(hog.clone(), now).unwrap_err(), Refused::Share { share: 4 });
        let theirs = fill(&admission, &other, now);
        assert_eq!(theirs.len(), 2, "what freed up went to the other client");
        hogged.truncate(4);
        assert_eq!(admission.admit_at(hog.clone(), now).unwrap_err(), Refused::Share { share: 4 }, "at its share with few places free");
        let more = fill(&admission, &other, now);
        assert_eq!(more.len(), 2, "the other client reaches its share");
        assert_eq!(admission.admit_at(other.clone(), now).unwrap_err(), Refused::Full);
    }

    #[test]
    fn a_share_is_enforced_only_once_few_places_are_free() {
        let admission = Admission::new(8);
        let now = Instant::now();
        let (a, b) = (address(1), address(2));
        let _b = admission.admit_at(b.clone(), now).unwrap();
        // Two clients, a share of 4 each: `a` may go past it while more
        // than a quarter of the places (2) are free.
        let held = fill(&admission, &a, now);
        assert_eq!(held.len(), 5, "a holds 5, b 1, and 2 stay free for b");
        assert_eq!(admission.admit_at(a.clone(), now).unwrap_err(), Refused::Share { share: 4 });
        let more_b = fill(&admission, &b, now);
        assert_eq!(more_b.len(), 2);
    }

    #[test]
    fn a_claim_lapses_when_its_client_stops_asking() {
        let admission = Admission::new(4);
        let now = Instant::now();
        let (hog, other) = (address(1), address(2));
        let mut hogged = fill(&admission, &hog, now);
        assert_eq!(admission.admit_at(other, now).unwrap_err(), Refused::Full);
        hogged.pop();
        assert!(admission.admit_at(hog.clone(), now).is_err(), "the other client's claim holds");
        let later = now + WANTING_FOR + Duration::from_secs(1);
        hogged.push(admission.admit_at(hog, later).expect("the claim lapsed: a lone client again"));
        assert!(admission.state.lock().wanting.is_empty());
    }

    #[test]
    fn claims_are_bounded_by_the_places() {
        let admission = Admission::new(2);
        let now = Instant::now();
        let _held = fill(&admission, &address(0), now);
        for last in 1..=50 {
            assert_eq!(admission.admit_at(address(last), now).unwrap_err(), Refused::Full);
        }
        assert_eq!(admission.state.lock().wanting.len(), 2);
    }

    #[test]
    fn tenants_are_clients_whatever_their_address() {
        let from = |last: u8| Some(IpAddr::from([10, 0, 0, last]));
        assert_eq!(Client::of(Some("acme"), from(1)), Client::of(Some("acme"), from(2)));
        assert_eq!(Client::of(None, from(1)), address(1));
        assert_ne!(Client::of(None, from(1)), Client::of(None, from(2)));
        assert_eq!(Client::of(None, None), Client::Unknown);
    }
}
