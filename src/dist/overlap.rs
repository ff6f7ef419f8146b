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

use std::sync::mpsc;

use anyhow::{anyhow, Result};

use super::group::ProcessGroup;

/// A collective and its follow-up, run on the communication thread.
pub type Job = Box<dyn FnOnce(&mut dyn ProcessGroup) -> Result<()> + Send>;

/// Where a caller hands its jobs while backward runs.
pub enum CommQueue {
    /// To the communication thread, now.
    Overlapped(mpsc::Sender<Job>),
    /// Kept, to run in order after the caller's work.
    Deferred(Vec<Job>),
}

impl CommQueue {
    pub fn submit(&mut self, job: Job) {
        match self {
            // The thread only goes away after a failure, which `with_queue` reports.
            CommQueue::Overlapped(tx) => {
                let _ = tx.send(job);
            }
            CommQueue::Deferred(jobs) => jobs.push(job),
        }
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
        let mut queue = CommQueue::Deferred(Vec::new());
        let out = work(&mut queue)?;
        let CommQueue::Deferred(jobs) = queue else {
            unreachable!("a deferred queue stays deferred")
        };
        for job in jobs {
            job(pg)?;
        }
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
