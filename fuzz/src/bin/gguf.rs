#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| reckon_fuzz::gguf(data));
