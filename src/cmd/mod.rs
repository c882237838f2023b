pub mod bench;
pub mod chat;
pub mod common;
pub mod info;
pub mod lab;
pub mod run;
pub mod serve;
