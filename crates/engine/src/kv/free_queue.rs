//! The free block queue: a doubly linked list over block ids held in two arrays, so that taking a cached
//! block back out of the middle (a prefix cache hit) is O(1), as are pushes at either end.

const NIL: u32 = u32::MAX;

#[derive(Debug)]
pub struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Whether each block is in the queue.
    queued: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    /// All of `0..n`, in order.
    pub fn new(n: u32) -> Self {
        let mut q = FreeQueue { prev: vec![NIL; n as usize], next: vec![NIL; n as usize], queued: vec![false; n as usize], head: NIL, tail: NIL, len: 0 };
        for b in 0..n {
            q.push_back(b);
        }
        q
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn push_back(&mut self, b: u32) {
        assert!(!self.queued[b as usize], "block {b} is already free");
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        match self.tail {
            NIL => self.head = b,
            t => self.next[t as usize] = b,
        }
        self.tail = b;
        self.queued[b as usize] = true;
        self.len += 1;
    }

    pub fn push_front(&mut self, b: u32) {
        assert!(!self.queued[b as usize], "block {b} is already free");
        self.next[b as usize] = self.head;
        self.prev[b as usize] = NIL;
        match self.head {
            NIL => self.tail = b,
            h => self.prev[h as usize] = b,
        }
        self.head = b;
        self.queued[b as usize] = true;
        self.len += 1;
    }

    pub fn pop_front(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.remove(b);
        Some(b)
    }

    /// Takes `b` out of the queue, wherever it is.
    pub fn remove(&mut self, b: u32) {
        assert!(self.queued[b as usize], "block {b} is not free");
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        match p {
            NIL => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.tail = p,
            n => self.prev[n as usize] = p,
        }
        self.queued[b as usize] = false;
        self.len -= 1;
    }

    /// Front first.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors(Some(self.head).filter(|&h| h != NIL), |&b| Some(self.next[b as usize]).filter(|&n| n != NIL))
    }
}
