//! Character classes and the GPT-2 byte alphabet, the way llama.cpp's unicode.cpp sees them.
//!
//! llama.cpp classifies a codepoint by its Unicode general category (`\p{L}`, `\p{N}`, `\p{P}`) plus the
//! White_Space property. Numbers and white space match Rust's `char::is_numeric` / `char::is_whitespace`
//! exactly; letters and punctuation have no `char` method, so their bits are taken from the regex
//! engine's Unicode tables, one 256-codepoint block at a time when a block is first needed (a full scan
//! would cost ~100 ms on the first request).

use std::sync::OnceLock;

/// The class a pre-tokenizer cares about. White space wins over every category (as in llama.cpp's
/// collapsed text), and anything that is none of the first three is `Other` (`[^\s\p{L}\p{N}]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    Letter,
    Number,
    Space,
    Other,
}

/// Letter and punctuation bits for one block of 256 codepoints.
struct Block {
    letter: [u64; 4],
    punct: [u64; 4],
}

const N_BLOCKS: usize = 0x110000 / 256;

fn build_block(block: usize) -> Block {
    static RES: OnceLock<(fancy_regex::Regex, fancy_regex::Regex)> = OnceLock::new();
    let (letter_re, punct_re) = RES.get_or_init(|| {
        let re = |p: &str| fancy_regex::Regex::new(p).expect("static regex");
        (re(r"\p{L}+"), re(r"\p{P}+"))
    });
    let base = (block * 256) as u32;
    let chars: String = (base..base + 256).filter_map(char::from_u32).collect();
    let bits = |re: &fancy_regex::Regex| {
        let mut bits = [0u64; 4];
        for m in re.find_iter(&chars).flatten() {
            for c in m.as_str().chars() {
                let i = c as usize - base as usize;
                bits[i / 64] |= 1 << (i % 64);
            }
        }
        bits
    };
    Block { letter: bits(letter_re), punct: bits(punct_re) }
}

fn block_of(c: char) -> &'static Block {
    static BLOCKS: OnceLock<Vec<OnceLock<Block>>> = OnceLock::new();
    let blocks = BLOCKS.get_or_init(|| (0..N_BLOCKS).map(|_| OnceLock::new()).collect());
    let b = c as usize >> 8;
    blocks[b].get_or_init(|| build_block(b))
}

fn bit(bits: &[u64; 4], c: char) -> bool {
    let i = c as usize & 255;
    bits[i / 64] >> (i % 64) & 1 == 1
}

/// `\p{L}`.
pub(crate) fn is_letter(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_alphabetic();
    }
    bit(&block_of(c).letter, c)
}

/// `\p{N}`: general categories Nd, Nl, No.
pub(crate) fn is_number(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_digit();
    }
    c.is_numeric()
}

/// `\p{P}`.
pub(crate) fn is_punctuation(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_punctuation() && !"$+<=>^`|~".contains(c);
    }
    bit(&block_of(c).punct, c)
}

/// White_Space: 0x09-0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2000-0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000.
pub(crate) fn is_space(c: char) -> bool {
    c.is_whitespace()
}

pub(crate) fn class(c: char) -> Class {
    if is_space(c) {
        Class::Space
    } else if is_letter(c) {
        Class::Letter
    } else if is_number(c) {
        Class::Number
    } else {
        Class::Other
    }
}

/// GPT-2's reversible byte <-> printable-char mapping: printable Latin-1 bytes stand for themselves, the
/// rest (controls, space, 0x7F-0xA0, 0xAD) are moved to U+0100 onwards, in byte order.
pub(crate) struct ByteAlphabet {
    to_char: [char; 256],
    /// Indexed by codepoint (all mapped chars are below U+0144); 0xFFFF where no byte maps there.
    from_char: [u16; 0x144],
}

impl ByteAlphabet {
    pub(crate) fn get() -> &'static ByteAlphabet {
        static A: OnceLock<ByteAlphabet> = OnceLock::new();
        A.get_or_init(|| {
            let mut to_char = ['\0'; 256];
            let mut n = 0u32;
            for b in 0..256u32 {
                let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
                to_char[b as usize] = if printable {
                    char::from_u32(b).unwrap()
                } else {
                    n += 1;
                    char::from_u32(255 + n).unwrap()
                };
            }
            let mut from_char = [0xFFFFu16; 0x144];
            for (b, &c) in to_char.iter().enumerate() {
                from_char[c as usize] = b as u16;
            }
            ByteAlphabet { to_char, from_char }
        })
    }

    pub(crate) fn encode(&self, b: u8) -> char {
        self.to_char[b as usize]
    }

    /// The byte a char of the alphabet stands for, or None for chars outside it.
    pub(crate) fn decode(&self, c: char) -> Option<u8> {
        match self.from_char.get(c as usize) {
            Some(&b) if b != 0xFFFF => Some(b as u8),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        assert_eq!(class('a'), Class::Letter);
        assert_eq!(class('é'), Class::Letter);
        assert_eq!(class('中'), Class::Letter);
        assert_eq!(class('7'), Class::Number);
        assert_eq!(class('²'), Class::Number);
        assert_eq!(class('\u{3000}'), Class::Space);
        assert_eq!(class('\u{a0}'), Class::Space);
        assert_eq!(class('\u{0301}'), Class::Other); // combining mark is not \p{L}
        assert_eq!(class('😀'), Class::Other);
        assert_eq!(class('\u{200d}'), Class::Other);
        assert!(is_punctuation('!') && is_punctuation('。') && !is_punctuation('$') && !is_punctuation('a'));
    }

    #[test]
    fn byte_alphabet_round_trips() {
        let a = ByteAlphabet::get();
        assert_eq!(a.encode(b' '), 'Ġ');
        assert_eq!(a.encode(b'\n'), 'Ċ');
        assert_eq!(a.encode(b'A'), 'A');
        for b in 0..=255u8 {
            assert_eq!(a.decode(a.encode(b)), Some(b));
        }
        assert_eq!(a.decode('中'), None);
    }
}
