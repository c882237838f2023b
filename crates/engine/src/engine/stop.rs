//! Stop strings over streamed text: text that might be the start of a stop string is held back until it
//! is known not to be, so a client never sees part of a stop string.

#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    /// The stop string that ended the generation.
    matched: Option<String>,
}

/// What to send after a delta.
#[derive(Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Send this text and go on.
    Continue(String),
    /// Send this text; a stop string was found and generation ends.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new(), matched: None }
    }

    pub fn push(&mut self, delta: &str) -> StopOutcome {
        self.held.push_str(delta);
        let first_stop = self.stops.iter().filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s))).min_by_key(|&(at, _)| at);
        if let Some((at, stop)) = first_stop {
            self.matched = Some(stop.clone());
            let out = self.held[..at].to_string();
            self.held.clear();
            return StopOutcome::Stopped(out);
        }
        // Hold back the longest tail that begins some stop string.
        let keep = self.stops.iter().map(|s| longest_tail_that_prefixes(&self.held, s)).max().unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopOutcome::Continue(out)
    }

    /// The stop string that ended the generation, if one did (Anthropic's `stop_sequence`).
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// The held-back text, at the end of a generation that did not stop on a string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Length of the longest suffix of `text` (on a char boundary) that is a proper prefix of `stop`.
fn longest_tail_that_prefixes(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_stop_strings_are_held_back() {
        let mut m = StopMatcher::new(vec!["</end>".into()]);
        assert_eq!(m.push("hello </"), StopOutcome::Continue("hello ".into()));
        assert_eq!(m.push("en"), StopOutcome::Continue("".into()));
        assert_eq!(m.push("try"), StopOutcome::Continue("</entry".into()));
        assert_eq!(m.push(" and </end> more"), StopOutcome::Stopped(" and ".into()));
        let mut m = StopMatcher::new(vec!["ab".into(), "x".into()]);
        assert_eq!(m.push("za"), StopOutcome::Continue("z".into()));
        assert_eq!(m.finish(), "a");
        assert_eq!(StopMatcher::new(vec!["é!".into()]).push("café"), StopOutcome::Continue("caf".into()));
    }

    use proptest::prelude::*;
    use proptest::sample::Index;

    /// Deterministic by default (a fixed seed; `PROPTEST_RNG_SEED` and `PROPTEST_CASES` still override),
    /// and no regression files written into the source tree.
    fn config(cases: u32) -> ProptestConfig {
        let base = ProptestConfig::default();
        ProptestConfig {
            cases: if std::env::var_os("PROPTEST_CASES").is_some() { base.cases } else { cases },
            rng_seed: match base.rng_seed {
                proptest::test_runner::RngSeed::Random => proptest::test_runner::RngSeed::Fixed(0x5709),
                fixed => fixed,
            },
            failure_persistence: None,
            ..base
        }
    }

    /// Few letters (so stop strings occur often), whitespace, and 2-, 3- and 4-byte chars.
    const ALPHABET: [char; 8] = ['a', 'b', 'c', ' ', '\n', 'é', '日', '🍕'];

    fn chars(max: usize) -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(ALPHABET.to_vec()), 0..max).prop_map(|v| v.into_iter().collect())
    }

    /// A text, its stop strings (0-4; each a piece of the text or a short random string, possibly empty),
    /// and the deltas it arrives in (split at random char boundaries).
    fn stream() -> impl Strategy<Value = (String, Vec<String>, Vec<String>)> {
        let stop = (any::<bool>(), any::<Index>(), 1..5usize, chars(4));
        (chars(40), prop::collection::vec(stop, 0..=4), prop::collection::vec(any::<Index>(), 0..12)).prop_map(|(text, stops, cuts)| {
            let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
            let stops = stops
                .into_iter()
                .map(|(from_text, at, len, random)| {
                    if from_text && !text.is_empty() {
                        let start = at.index(bounds.len() - 1);
                        text[bounds[start]..bounds[(start + len).min(bounds.len() - 1)]].to_string()
                    } else {
                        random
                    }
                })
                .collect();
            let mut cuts: Vec<usize> = cuts.iter().map(|i| bounds[i.index(bounds.len())]).chain([0, text.len()]).collect();
            cuts.sort_unstable();
            cuts.dedup();
            let deltas = cuts.windows(2).map(|w| text[w[0]..w[1]].to_string()).collect();
            (text, stops, deltas)
        })
    }

    /// Where the first stop string begins in `text` (empty stop strings are ignored), if any does.
    fn first_stop(text: &str, stops: &[String]) -> Option<usize> {
        stops.iter().filter(|s| !s.is_empty()).filter_map(|s| text.find(s.as_str())).min()
    }

    /// The naive answer: the text received up to the first delta after which it holds a stop string,
    /// cut where the earliest stop string in it begins (as llama.cpp's server does per token); all of
    /// the text if no stop string ever appears. Text after that delta is never generated, so a stop
    /// string that would begin earlier but end only in a later delta does not count.
    fn naive(deltas: &[String], stops: &[String]) -> (String, bool) {
        let mut text = String::new();
        for d in deltas {
            text.push_str(d);
            if let Some(at) = first_stop(&text, stops) {
                text.truncate(at);
                return (text, true);
            }
        }
        (text, false)
    }

    proptest! {
        #![proptest_config(config(10_000))]

        /// Against the naive answer (`naive`: the text up to the first stop string, or all of it):
        /// the emitted text is exactly that; nothing past it is ever emitted; the matcher stops on
        /// the very delta that completes the first stop string; and it holds back no more than could
        /// still become a stop string (shorter than the longest one).
        #[test]
        fn stop_matcher_equals_the_naive_cut((text, stops, deltas) in stream()) {
            let (want, stops_at_all) = naive(&deltas, &stops);
            prop_assert_eq!(deltas.concat(), text);
            let longest = stops.iter().map(String::len).max().unwrap_or(0);
            let mut m = StopMatcher::new(stops.clone());
            let (mut pushed, mut out, mut stopped) = (String::new(), String::new(), false);
            for d in &deltas {
                pushed.push_str(d);
                match m.push(d) {
                    StopOutcome::Continue(s) => {
                        out.push_str(&s);
                        prop_assert!(first_stop(&pushed, &stops).is_none(), "went on past a stop string: {:?}", pushed);
                        prop_assert!(pushed.len() - out.len() < longest.max(1), "holds back {:?} of {:?}", &pushed[out.len()..], pushed);
                    }
                    StopOutcome::Stopped(s) => {
                        out.push_str(&s);
                        prop_assert!(first_stop(&pushed, &stops).is_some(), "stopped on {:?} without a stop string", pushed);
                        stopped = true;
                    }
                }
                prop_assert!(want.starts_with(out.as_str()), "emitted {:?}, past {:?}", out, want);
                if stopped {
                    break;
                }
            }
            if !stopped {
                out.push_str(&m.finish());
            }
            prop_assert_eq!(stopped, stops_at_all);
            prop_assert_eq!(out, want);
        }
    }
}
