//! The requests the server has handed to an engine and not yet seen answered, so that it can cancel
//! them: when their client goes away, when they run past their `timeout`, and at the end of a drain.
//!
//! Every accepted request gets a [`Ticket`] here before it goes to its engine and leaves when the
//! engine answers it (exactly once). Cancelling records the [`CancelCause`] and sends the engine a
//! `Cancel` command; the engine stops the request's GPU work and answers `Cancelled`, which the
//! submission path turns into the cause's error (504 / DEADLINE_EXCEEDED for a timeout, 503 /
//! UNAVAILABLE for a drain). The table is bounded by what the engines accept (their submission
//! queues and job limits): it holds no request an engine refused.

use kairos_sched::RequestId;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Why the server cancelled a request (the `cause` label of `kairos_requests_cancelled_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CancelCause {
    /// The client closed its connection (REST, gRPC, shared memory) before the answer.
    ClientGone,
    /// The request ran past its `timeout` parameter.
    Timeout,
    /// The server drained and its deadline came first.
    Drain,
}

impl CancelCause {
    pub const ALL: [CancelCause; 3] = [CancelCause::ClientGone, CancelCause::Timeout, CancelCause::Drain];

    pub fn label(self) -> &'static str {
        match self {
            CancelCause::ClientGone => "client_gone",
            CancelCause::Timeout => "timeout",
            CancelCause::Drain => "drain",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// An accepted request, for [`crate::State::cancel`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket(pub(crate) u64);

/// What the table knows of one request.
#[derive(Debug)]
pub(crate) struct Entry {
    pub gpu: u32,
    /// The engine's id, once the submission returned it.
    pub id: Option<RequestId>,
    pub deadline: Option<Instant>,
    pub timeout: Option<Duration>,
    /// The shared-memory connection that sent it.
    pub owner: Option<u64>,
    pub cause: Option<CancelCause>,
}

#[derive(Default)]
pub(crate) struct Table {
    next: u64,
    pub entries: HashMap<u64, Entry>,
    /// (deadline, ticket) of the requests with a timeout.
    pub deadlines: BTreeSet<(Instant, u64)>,
    /// Cancels the engine's full queue refused: (gpu, id), sent again by the watchdog.
    pub retry: Vec<(u32, RequestId)>,
    /// The watchdog stops.
    pub stop: bool,
}

/// The table and its condition variable (signalled when a request leaves, when a deadline is
/// added, and when the watchdog has work or must stop).
#[derive(Default)]
pub(crate) struct InFlight {
    table: Mutex<Table>,
    pub changed: Condvar,
}

impl InFlight {
    pub fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a request about to be submitted to the engine of `gpu`.
    pub fn register(&self, gpu: u32, timeout: Option<Duration>, owner: Option<u64>) -> Ticket {
        let mut t = self.lock();
        t.next += 1;
        let ticket = t.next;
        let deadline = timeout.map(|d| Instant::now() + d);
        if let Some(d) = deadline {
            t.deadlines.insert((d, ticket));
        }
        t.entries.insert(ticket, Entry { gpu, id: None, deadline, timeout, owner, cause: None });
        drop(t);
        if deadline.is_some() {
            self.changed.notify_all();
        }
        Ticket(ticket)
    }

    /// The engine accepted the request as `id`: if a cancel came meanwhile, it is due now (the
    /// caller sends it).
    pub fn accepted(&self, ticket: Ticket, id: RequestId) -> Option<(u32, RequestId)> {
        let mut t = self.lock();
        let e = t.entries.get_mut(&ticket.0)?;
        e.id = Some(id);
        e.cause.map(|_| (e.gpu, id))
    }

    /// The request left (answered, or refused at submission): its entry, if it was still there.
    pub fn finish(&self, ticket: Ticket) -> Option<Entry> {
        let mut t = self.lock();
        let e = t.entries.remove(&ticket.0)?;
        if let Some(d) = e.deadline {
            t.deadlines.remove(&(d, ticket.0));
        }
        drop(t);
        self.changed.notify_all();
        Some(e)
    }

    /// Marks a request cancelled for `cause` (the first cause wins); the cancel to send, if the
    /// engine's id is known (else [`InFlight::accepted`] hands it out).
    pub fn mark(t: &mut Table, ticket: u64, cause: CancelCause) -> Option<(u32, RequestId)> {
        let e = t.entries.get_mut(&ticket)?;
        if e.cause.is_some() {
            return None;
        }
        e.cause = Some(cause);
        e.id.map(|id| (e.gpu, id))
    }

    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }
}
