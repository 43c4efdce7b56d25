//! The act wing: who carries out a decision's actions.
//!
//! - [`connector`]: the connectors (`virtual`, `local`, `kubernetes`,
//!   `hosted`) and handing actions to them, each once, recorded in the
//!   ledger;
//! - [`scale`]: the one scale loop of the connectors that start and drain
//!   workers themselves, over a [`scale::WorkerHost`];
//! - [`local`]: worker processes on this machine (a `WorkerHost`);
//! - [`kubernetes`]: each pool a Deployment, scaled through its scale
//!   subresource.

pub mod connector;
pub mod kubernetes;
pub mod local;
pub mod scale;
