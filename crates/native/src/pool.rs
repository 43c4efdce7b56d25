//! A small fork-join thread pool for the engine's kernels.
//!
//! One forward pass issues a few hundred short parallel loops (every matmul,
//! the attention), so dispatch must cost about a microsecond, not the tens
//! a general-purpose pool costs: workers spin briefly on a generation
//! counter before parking, and the caller works on the loop too.

#![allow(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// Spin iterations an idle worker waits before parking (tens of
/// microseconds: long enough to catch the next loop of the same step).
const SPIN_ITERATIONS: u32 = 1 << 14;

/// The job being run: a type-erased `&(dyn Fn(usize) + Sync)` valid until
/// every worker has finished it (the dispatcher waits for that).
#[derive(Clone, Copy)]
struct Job {
    data: *const (),
    call: unsafe fn(*const (), usize),
    tasks: usize,
}

// SAFETY: `data` points to a `Sync` closure; the pool only dereferences it
// while `run` keeps the closure borrowed (see `run`).
unsafe impl Send for Job {}

struct Shared {
    /// Bumped once per job; workers run a job when it changes.
    generation: AtomicUsize,
    /// Next task index to hand out.
    next: AtomicUsize,
    /// Workers that have not finished the current job.
    busy: AtomicUsize,
    stop: AtomicBool,
    job: parking_lot::Mutex<Option<Job>>,
}

/// A pool of `threads - 1` workers plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    dispatch: parking_lot::Mutex<()>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool").field("threads", &self.threads()).finish()
    }
}

/// Calls the closure behind a [`Job`]'s type-erased pointer.
///
/// # Safety
/// `data` must come from a live `&F` (as `run` makes it, keeping the borrow
/// until every worker has finished the job).
unsafe fn call_closure<F: Fn(usize) + Sync>(data: *const (), task: usize) {
    // SAFETY: `data` was made from `&F` in `run`, which outlives the job.
    let closure = unsafe { &*(data as *const F) };
    closure(task);
}

impl ThreadPool {
    /// A pool running loops on `threads` threads (the caller included).
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            busy: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            job: parking_lot::Mutex::new(None),
        });
        let workers = (1..threads)
            .map(|index| {
                let shared = shared.clone();
                thread::Builder::new().name(format!("turbine-kernel-{index}")).spawn(move || worker(&shared)).expect("spawn kernel thread")
            })
            .collect();
        Self { shared, workers, dispatch: parking_lot::Mutex::new(()) }
    }

    /// Threads that run loops (the caller included).
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(0..tasks)` across the pool and returns when every task is
    /// done. Tasks are handed out dynamically, one index at a time.
    pub fn run<F: Fn(usize) + Sync>(&self, tasks: usize, f: F) {
        if tasks == 0 {
            return;
        }
        if self.workers.is_empty() || tasks == 1 {
            (0..tasks).for_each(f);
            return;
        }
        let _one_job_at_a_time = self.dispatch.lock();
        let shared = &*self.shared;
        *shared.job.lock() = Some(Job { data: &f as *const F as *const (), call: call_closure::<F>, tasks });
        shared.next.store(0, Ordering::Relaxed);
        shared.busy.store(self.workers.len(), Ordering::Relaxed);
        shared.generation.fetch_add(1, Ordering::Release);
        for worker in &self.workers {
            worker.thread().unpark();
        }
        run_tasks(shared, &f, tasks);
        // `f` must stay alive until every worker has let go of it.
        while shared.busy.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        *shared.job.lock() = None;
    }
}

fn run_tasks<F: Fn(usize) + ?Sized>(shared: &Shared, f: &F, tasks: usize) {
    loop {
        let task = shared.next.fetch_add(1, Ordering::Relaxed);
        if task >= tasks {
            return;
        }
        f(task);
    }
}

fn worker(shared: &Shared) {
    let mut seen = 0usize;
    loop {
        // Wait for a new generation: spin a little, then park.
        let mut spins = 0u32;
        loop {
            if shared.stop.load(Ordering::Acquire) {
                return;
            }
            if shared.generation.load(Ordering::Acquire) != seen {
                break;
            }
            if spins < SPIN_ITERATIONS {
                spins += 1;
                std::hint::spin_loop();
            } else {
                thread::park_timeout(Duration::from_millis(10));
            }
        }
        seen = shared.generation.load(Ordering::Acquire);
        let job = *shared.job.lock();
        if let Some(job) = job {
            let call = |task: usize| {
                // SAFETY: the dispatcher keeps the closure alive until `busy`
                // reaches zero, which happens only after this worker's last
                // call (the decrement below).
                unsafe { (job.call)(job.data, task) }
            };
            run_tasks(shared, &call, job.tasks);
        }
        shared.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for worker in &self.workers {
            worker.thread().unpark();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use super::*;

    #[test]
    fn every_task_runs_exactly_once() {
        let pool = ThreadPool::new(3);
        for tasks in [0, 1, 2, 7, 1000] {
            let hits: Vec<AtomicU64> = (0..tasks).map(|_| AtomicU64::new(0)).collect();
            pool.run(tasks, |task| {
                hits[task].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn many_short_jobs_in_a_row() {
        let pool = ThreadPool::new(2);
        let total = AtomicU64::new(0);
        for _ in 0..10_000 {
            pool.run(4, |task| {
                total.fetch_add(task as u64, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 10_000 * 6);
    }
}
