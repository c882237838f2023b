//! Stop strings over streamed text: text that might be the start of a stop string is held back until it
//! is known not to be, so a client never sees part of a stop string.

#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
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
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new() }
    }

    pub fn push(&mut self, delta: &str) -> StopOutcome {
        self.held.push_str(delta);
        let first_stop = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = first_stop {
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
}
