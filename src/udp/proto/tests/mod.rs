//! Tests of the protocol as a whole: scenarios on the simulated link, and
//! single-connection unit and property tests. Codec and sequence-number
//! tests live beside their code.

mod forgery;
mod scenarios;
mod unit;
