//! KV-aware routing: DESIGN §5's cost function over the global KV index.
//!
//! For each candidate worker the router knows how many leading blocks of the
//! prompt it caches (per tier, from the KV index) and how much work is
//! already booked on it (blocks still to prefill, blocks being decoded):
//!
//! ```text
//! credits = device·d + host·h + disk·k + remote·r        (matched blocks per tier)
//! prefill = active_prefill_blocks + prompt_blocks − credits
//! cost    = prefill_load_scale·prefill + active_decode_blocks + prompt_blocks
//! ```
//!
//! DESIGN §5 (Dynamo) clamps `prefill` at 0. With credits of at most 1 per
//! block (Dynamo's weights) the clamp never binds, since credits never
//! exceed the prompt's blocks. With Turbine's default device credit of 8 it
//! would: every worker matching an eighth of an idle prompt would cost the
//! same, and a conversation's turn could go to a worker holding only its
//! first turns. Unclamped, a deeper match is always cheaper.
//!
//! Temperature 0 picks the cheapest (ties: the smaller cached tree, so new
//! prefixes spread out; then random); a positive temperature samples with
//! probability ∝ exp(−(cost/(max−min))/T).
//!
//! - [`cost`]: the function and the choice, pure.
//! - [`config`]: the `[kv]` section.
//! - [`state`]: where the matches come from ([`KvState::look_up`], through
//!   a `KvIndexClient`: the router's own replica, or a kv-index service),
//!   and *approximate* mode for engines that publish no KV events: the
//!   router records its own decisions as if the chosen worker had stored
//!   the prompt's blocks, and forgets them after a TTL or when the record
//!   outgrows its size bound.

pub mod config;
pub mod cost;
pub mod state;

pub use config::{KvConfig, KvTuning};
pub use cost::{KvCandidate, KvOverrides, KvWeights, choose, cost};
pub use state::{KvLookup, KvState, KvView};
