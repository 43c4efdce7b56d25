//! Copy threads: copying a batch of blocks out of a mapped pool on more
//! than one core (one thread does not reach the memory bandwidth).

use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

/// Copy threads: more than one core copies a batch of blocks (one thread
/// does not reach the memory bandwidth).
pub(crate) struct Copier {
    lanes: Vec<mpsc::Sender<CopyTask>>,
    threads: Vec<JoinHandle<()>>,
}

/// Spans for one copy thread: `(source, destination)` addresses of `len`
/// bytes each.
struct CopyTask {
    spans: Vec<(usize, usize)>,
    len: usize,
    done: Arc<Countdown>,
}

impl CopyTask {
    /// Copies the spans, then counts the task done.
    ///
    /// # Safety
    /// As [`Copier::post`]'s contract.
    #[allow(unsafe_code)]
    unsafe fn run(&self) {
        for &(source, destination) in &self.spans {
            // SAFETY: the caller's contract.
            unsafe { std::ptr::copy_nonoverlapping(source as *const u8, destination as *mut u8, self.len) };
        }
        self.done.finish_one();
    }
}

/// Counts copy tasks down to zero.
pub(crate) struct Countdown {
    left: Mutex<usize>,
    zero: Condvar,
}

impl Countdown {
    fn finish_one(&self) {
        let mut left = self.left.lock();
        *left -= 1;
        if *left == 0 {
            self.zero.notify_all();
        }
    }

    /// Returns when every task is done.
    pub(crate) fn wait(&self) {
        let mut left = self.left.lock();
        while *left > 0 {
            self.zero.wait(&mut left);
        }
    }
}

/// Copy threads per worker: the cores, up to four.
pub(crate) fn copy_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |cores| cores.get().min(4))
}

impl Copier {
    pub(crate) fn new(threads: usize) -> Self {
        let mut lanes = Vec::new();
        let mut handles = Vec::new();
        for lane in 0..threads.max(1) {
            let (sender, tasks) = mpsc::channel::<CopyTask>();
            let spawned = std::thread::Builder::new().name(format!("turbine-kv-copy-{lane}")).spawn(move || {
                for task in tasks {
                    // SAFETY: per `Copier::post`'s contract.
                    #[allow(unsafe_code)]
                    unsafe {
                        task.run()
                    };
                }
            });
            match spawned {
                Ok(handle) => {
                    lanes.push(sender);
                    handles.push(handle);
                }
                Err(error) => tracing::warn!(%error, "cannot start a KV copy thread"),
            }
        }
        Self { lanes, threads: handles }
    }

    /// Hands the copies of `len` bytes from each source to
    /// `destination + i × len` to the copy threads; the countdown reaches
    /// zero when all are done (at once without threads: copied here).
    ///
    /// # Safety
    /// Every source stays readable for `len` bytes, and the destination
    /// writable for `sources.len() × len` bytes and otherwise untouched,
    /// until the countdown reaches zero.
    #[allow(unsafe_code)]
    pub(crate) unsafe fn post(&self, sources: &[*const u8], destination: *mut u8, len: usize) -> Arc<Countdown> {
        let per_lane = sources.len().div_ceil(self.lanes.len().max(1)).max(1);
        let chunks: Vec<&[*const u8]> = sources.chunks(per_lane).collect();
        let done = Arc::new(Countdown { left: Mutex::new(chunks.len()), zero: Condvar::new() });
        for (lane, chunk) in chunks.into_iter().enumerate() {
            let first = lane * per_lane;
            let spans = chunk.iter().enumerate().map(|(i, &source)| (source as usize, destination as usize + (first + i) * len)).collect();
            let task = CopyTask { spans, len, done: done.clone() };
            let refused = match self.lanes.get(lane) {
                Some(sender) => sender.send(task).err().map(|mpsc::SendError(task)| task),
                None => Some(task),
            };
            if let Some(task) = refused {
                // No thread for this lane: copy here.
                // SAFETY: per the caller's contract.
                unsafe { task.run() };
            }
        }
        done
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        self.lanes.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}
