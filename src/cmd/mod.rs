pub mod bench;
pub mod chat;
pub mod common;
pub mod info;
pub mod lab;
pub mod lab_serve;
pub mod run;
pub mod serve;
