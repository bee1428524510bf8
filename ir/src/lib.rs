//! asteria's intermediate representation: a closed [`Op`] enum over a petgraph `StableGraph`
//! of instructions with typed SSA values ([`ValueId`], printed `%name`), program sections and
//! a layout, the run [`config::Config`], a text printer and parser that round-trip, and a
//! verifier whose errors name the IR entity.
#![deny(missing_docs)]

pub mod config;
mod module;
mod op;
mod parser;
mod printer;
mod types;
mod verifier;

pub use module::{Inst, InstId, Module, ValueData, ValueId};
pub use op::{InputRole, Op, Section};
pub use parser::{parse_module, ParseError};
pub use schedule::{limits, PLAN_FORMAT};
pub use schedule::{
    AttentionKernel, Budgets, BufferClass, DType, Eigensolver, HostUpdates, Init, InverseRoot,
    KlShampooHyper, Placement, Precision, RefreshMethod, RefreshPlacement, RefreshSwap,
    Rematerialize, ShampooHyper, SoapHyper, WeightCasts,
};
pub use types::TensorType;
pub use verifier::{verify, VerifierError};
