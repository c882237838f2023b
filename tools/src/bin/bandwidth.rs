//! Memory bandwidth probe for the decode roofline (`reckon_lab::bandwidth`): prints the median read and
//! copy GB/s of T threads as JSON.
//!   cargo run --release -p reckon-tools --bin bandwidth -- [THREADS]

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2);
    let b = reckon_lab::bandwidth::measure(threads);
    println!("{{\"threads\": {}, \"read_gb_s\": {:.2}, \"copy_gb_s\": {:.2}}}", b.threads, b.read_gb_s, b.copy_gb_s);
}
