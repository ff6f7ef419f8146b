//! Collectives that run while backward goes on: a queue of jobs (a collective and what to do
//! with its result) consumed by a communication thread, so that a bucket's gradient reduction
//! starts as soon as its layers' gradients are final and hides behind the backward of the
//! layers below (DDP's overlap; Megatron's "overlap_grad_reduce").
//!
//! The same jobs run in the same order whether they overlap or not ([`CommQueue::Deferred`]
//! runs them after backward, on the caller's thread), so the two are bitwise equal: the
//! results depend only on the buckets and the collectives, not on when they ran.
//!
//! Rules the jobs keep: the caller issues no collective of its own while the queue is open
//! (the group is the communication thread's until [`with_queue`] returns), and a job touches
//! only tensors that backward no longer writes (the gradients of units already final, its own
//! buffers).
//!
//! A caller that needs a job's result before it can go on (zero stage 3 needs a unit's gathered
//! parameters before its forward) waits for it with [`CommQueue::wait`]: overlapped, on the
//! job's answer; deferred, by running every job queued so far first, so the order of the
//! collectives is the same either way.

use std::sync::mpsc;

use anyhow::{anyhow, Result};

use super::group::ProcessGroup;

/// A collective and its follow-up, run on the communication thread.
pub type Job = Box<dyn FnOnce(&mut dyn ProcessGroup) -> Result<()> + Send>;

/// Where a caller hands its jobs while backward runs.
pub enum CommQueue<'a> {
    /// To the communication thread, now.
    Overlapped(mpsc::Sender<Job>),
    /// Kept, to run in order after the caller's work (or when it waits for one).
    Deferred {
        jobs: Vec<Job>,
        pg: &'a mut dyn ProcessGroup,
    },
}

impl CommQueue<'_> {
    pub fn submit(&mut self, job: Job) {
        match self {
            // The thread only goes away after a failure, which `with_queue` reports.
            CommQueue::Overlapped(tx) => {
                let _ = tx.send(job);
            }
            CommQueue::Deferred { jobs, .. } => jobs.push(job),
        }
    }

    /// Waits for the answer a submitted job sends on `rx`. Deferred, the jobs queued so far
    /// run now, in order. A job that failed sends nothing: the error then says so, and
    /// [`with_queue`] returns the job's own error in preference to it.
    pub fn wait<T>(&mut self, rx: &mpsc::Receiver<T>) -> Result<T> {
        if let CommQueue::Deferred { jobs, pg } = self {
            for job in jobs.drain(..) {
                job(&mut **pg)?;
            }
        }
        rx.recv()
            .map_err(|_| anyhow!("a collective on the communication thread failed"))
    }

    fn finish(self) -> Result<()> {
        if let CommQueue::Deferred { jobs, pg } = self {
            for job in jobs {
                job(&mut *pg)?;
            }
        }
        Ok(())
    }
}

/// Runs `work(queue)` while the jobs it submits run on a communication thread (`overlap`), or
/// after it on this thread; returns `work`'s result once every job has run. A failed job stops
/// the ones after it and is the error returned.
pub fn with_queue<T>(
    pg: &mut dyn ProcessGroup,
    overlap: bool,
    work: impl FnOnce(&mut CommQueue) -> Result<T>,
) -> Result<T> {
    if !overlap {
        let mut queue = CommQueue::Deferred {
            jobs: Vec::new(),
            pg,
        };
        let out = work(&mut queue)?;
        queue.finish()?;
        return Ok(out);
    }
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel::<Job>();
        let comm = s.spawn(move || -> Result<()> {
            for job in rx {
                job(pg)?;
            }
            Ok(())
        });
        let mut queue = CommQueue::Overlapped(tx);
        let out = work(&mut queue);
        drop(queue); // closes the channel: the thread ends after the last job
        let comm = comm
            .join()
            .map_err(|_| anyhow!("the communication thread panicked"))?;
        // A collective's failure (a lost peer) explains a failure of the work too.
        comm?;
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::SingleProcess;
    use std::sync::{Arc, Mutex};

    #[test]
    fn jobs_run_in_order_overlapped_or_not() {
        for overlap in [false, true] {
            let seen = Arc::new(Mutex::new(Vec::new()));
            let out = with_queue(&mut SingleProcess, overlap, |q| {
                for i in 0..5 {
                    let seen = Arc::clone(&seen);
                    q.submit(Box::new(move |pg| {
                        pg.barrier()?;
                        seen.lock().unwrap().push(i);
                        Ok(())
                    }));
                }
                Ok(7)
            })
            .unwrap();
            assert_eq!(out, 7);
            assert_eq!(*seen.lock().unwrap(), [0, 1, 2, 3, 4], "overlap {overlap}");
        }
    }

    #[test]
    fn a_caller_can_wait_for_a_job_and_the_order_stays() {
        for overlap in [false, true] {
            let seen = Arc::new(Mutex::new(Vec::new()));
            let got = with_queue(&mut SingleProcess, overlap, |q| {
                let first = Arc::clone(&seen);
                q.submit(Box::new(move |_| {
                    first.lock().unwrap().push(1);
                    Ok(())
                }));
                let (tx, rx) = mpsc::channel();
                let second = Arc::clone(&seen);
                q.submit(Box::new(move |_| {
                    second.lock().unwrap().push(2);
                    let _ = tx.send(42);
                    Ok(())
                }));
                q.wait(&rx)
            })
            .unwrap();
            assert_eq!(got, 42);
            assert_eq!(*seen.lock().unwrap(), [1, 2], "overlap {overlap}");
        }
    }

    #[test]
    fn a_failed_job_is_the_error_and_stops_the_rest() {
        for overlap in [false, true] {
            let ran = Arc::new(Mutex::new(0));
            let r = with_queue(&mut SingleProcess, overlap, |q| {
                q.submit(Box::new(|_| anyhow::bail!("peer lost")));
                let ran = Arc::clone(&ran);
                q.submit(Box::new(move |_| {
                    *ran.lock().unwrap() += 1;
                    Ok(())
                }));
                Ok(())
            });
            assert_eq!(r.unwrap_err().to_string(), "peer lost");
            assert_eq!(*ran.lock().unwrap(), 0);
        }
    }
}
