//! Zeroed buffers of anonymous memory that the kernel may back with 2 MiB pages.
//!
//! Why: a serving step reads the KV cells of every running sequence, scattered over a pool of tens to
//! hundreds of MiB, and the packed weights end to end. With 4 KiB pages a step touches tens of thousands
//! of pages, far more than the TLB holds, and the attention's key loads waited on page walks. Linux's
//! default transparent-huge-page mode is `madvise`: memory gets 2 MiB pages only when asked, as here.
//! Where the kernel says no (another OS, THP off) the buffer is still correct, only on small pages.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// Element types whose all-zero bytes are a valid value (the buffer starts zeroed).
///
/// # Safety
/// Implement only for plain data types for which every all-zero bit pattern is a valid value.
pub unsafe trait Zeroable: Copy {}
unsafe impl Zeroable for u8 {}
unsafe impl Zeroable for i8 {}
unsafe impl Zeroable for u16 {}
unsafe impl Zeroable for f32 {}
unsafe impl Zeroable for half::f16 {}
unsafe impl Zeroable for crate::kernels::ggml::Line {}

/// `len` elements of `T`, zeroed, in their own anonymous mapping advised for huge pages (or on the heap
/// when small, or when the map cannot be made).
pub struct HugeBuf<T: Zeroable> {
    store: Store<T>,
    len: usize,
    _elem: PhantomData<T>,
}

enum Store<T> {
    Map(memmap2::MmapMut),
    Heap(Vec<T>),
}

impl<T: Zeroable> HugeBuf<T> {
    /// Smaller buffers stay on the heap's small pages: a huge page for them would be mostly empty.
    const MIN_HUGE_BYTES: usize = 1 << 21;

    pub fn zeroed(len: usize) -> Self {
        let bytes = len.saturating_mul(std::mem::size_of::<T>());
        // SAFETY: all-zero bytes are a valid T (`Zeroable`).
        let zero: T = unsafe { std::mem::zeroed() };
        let heap = |len| HugeBuf { store: Store::Heap(vec![zero; len]), len, _elem: PhantomData };
        if bytes < Self::MIN_HUGE_BYTES || !huge_pages_wanted() {
            return heap(len);
        }
        // An anonymous map is zero-filled and page-aligned, so any `T` (alignment ≤ 4 KiB) may live in it.
        match memmap2::MmapMut::map_anon(bytes) {
            Ok(map) => {
                #[cfg(target_os = "linux")]
                // Advice only: an error (THP compiled out) leaves ordinary pages.
                let _ = map.advise(memmap2::Advice::HugePage);
                HugeBuf { store: Store::Map(map), len, _elem: PhantomData }
            }
            Err(_) => heap(len),
        }
    }
}

static HUGE_PAGES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether buffers made from now on may get huge pages (the default); false keeps them on the heap's
/// small pages (`--no-huge-pages`, and for measuring what huge pages buy).
pub fn set_huge_pages(on: bool) {
    HUGE_PAGES.store(on, std::sync::atomic::Ordering::Relaxed);
}

fn huge_pages_wanted() -> bool {
    HUGE_PAGES.load(std::sync::atomic::Ordering::Relaxed)
}

impl<T: Zeroable> Deref for HugeBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.store {
            // SAFETY: the map holds `len * size_of::<T>()` initialised bytes, aligned for T (page
            // alignment), zero bytes are a valid T (`Zeroable`), and the map lives as long as `self`.
            Store::Map(m) => unsafe { std::slice::from_raw_parts(m.as_ptr() as *const T, self.len) },
            Store::Heap(v) => v,
        }
    }
}

impl<T: Zeroable> DerefMut for HugeBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.store {
            // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
            Store::Map(m) => unsafe { std::slice::from_raw_parts_mut(m.as_mut_ptr() as *mut T, self.len) },
            Store::Heap(v) => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_zeroed_and_holds_what_is_written() {
        for len in [0usize, 1, 1000, 3 << 20] {
            let mut b = HugeBuf::<f32>::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0.0));
            if len > 1 {
                b[0] = 1.5;
                b[len - 1] = 2.5;
                assert_eq!((b[0], b[1], b[len - 1]), (1.5, if len == 2 { 2.5 } else { 0.0 }, 2.5));
            }
        }
    }
}
