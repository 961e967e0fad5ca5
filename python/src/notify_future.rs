//! Receiving a notification as an asyncio awaitable such that cancelling it never consumes one.
//!
//! A receive runs on the package's runtime and, once it took a message, hands it to the event
//! loop (`call_soon_threadsafe`). The hand-over runs on the loop's thread, where cancellation
//! happens too, so it sees for certain whether the awaitable is still waiting: if it is, the
//! message becomes its result; if it was cancelled meanwhile (task cancel, `asyncio.wait_for`
//! timing out, leaving `async for`), the message goes back to the front of the inbox for the
//! next receive. Cancelling also aborts the waiting receive, which takes nothing while it waits.

use parking_lot::Mutex;
use pyo3::exceptions::PyStopAsyncIteration;
use pyo3::prelude::*;
use te_base::Notification;
use te_core::Notifications;

use crate::engine::notification;
use crate::runtime::runtime;

/// An awaitable for the next notification of `inbox`: the notification, or at the end (engine
/// shut down, queue empty) None, or with `stop_at_end` a `StopAsyncIteration` (`__anext__`).
pub fn next<'py>(py: Python<'py>, inbox: Notifications, stop_at_end: bool) -> PyResult<Bound<'py, PyAny>> {
    let event_loop = py.import("asyncio")?.call_method0("get_running_loop")?;
    let fut = event_loop.call_method0("create_future")?;
    let (loop_ref, fut_ref) = (event_loop.unbind(), fut.clone().unbind());
    let task = runtime().spawn(async move {
        let got = inbox.recv().await;
        // Nothing below awaits: once a message is taken, an abort can no longer drop it, and the
        // hand-over (which waits for the GIL) runs off the runtime's workers.
        runtime().spawn_blocking(move || hand_over(loop_ref, fut_ref, inbox, got, stop_at_end));
    });
    fut.call_method1("add_done_callback", (AbortOnCancel(Mutex::new(Some(task))),))?;
    Ok(fut)
}

/// Schedules the hand-over on the event loop. Where it never runs (the loop closed, the
/// interpreter finalizing), dropping the `Deliver` puts the message back.
fn hand_over(
    event_loop: Py<PyAny>,
    fut: Py<PyAny>,
    inbox: Notifications,
    got: Option<Notification>,
    stop_at_end: bool,
) {
    let deliver = Deliver {
        fut,
        inbox,
        got: Mutex::new(Some(got)),
        stop_at_end,
    };
    crate::runtime::attach_from_runtime(move |py| -> PyResult<()> {
        let deliver = Py::new(py, deliver)?;
        event_loop.bind(py).call_method1("call_soon_threadsafe", (deliver,))?;
        Ok(())
    });
}

/// Runs on the event loop's thread: the awaitable's result, unless it was cancelled meanwhile;
/// a message not handed over goes back to the inbox when this is dropped.
#[pyclass(module = "te._native", frozen)]
struct Deliver {
    fut: Py<PyAny>,
    inbox: Notifications,
    got: Mutex<Option<Option<Notification>>>,
    stop_at_end: bool,
}

impl Drop for Deliver {
    fn drop(&mut self) {
        if let Some(Some(n)) = self.got.get_mut().take() {
            self.inbox.put_back(n);
        }
    }
}

#[pymethods]
impl Deliver {
    fn __call__(&self, py: Python<'_>) -> PyResult<()> {
        let fut = self.fut.bind(py);
        // Cancelled meanwhile: keep the message (dropping `self` puts it back). Both this check
        // and cancellation run on the loop's thread, so the answer cannot change before the
        // result is set below.
        if fut.call_method0("done")?.is_truthy()? {
            if let Some(Some(n)) = self.got.lock().take() {
                self.inbox.put_back(n);
            }
            return Ok(());
        }
        let Some(got) = self.got.lock().take() else {
            return Ok(());
        };
        match got {
            Some(n) => {
                fut.call_method1("set_result", (Py::new(py, notification(py, n))?,))?;
            }
            None if self.stop_at_end => {
                fut.call_method1("set_exception", (PyStopAsyncIteration::new_err(()).into_value(py),))?;
            }
            None => {
                fut.call_method1("set_result", (py.None(),))?;
            }
        }
        Ok(())
    }
}

/// The awaitable's done-callback: a cancelled awaitable stops its receive.
#[pyclass(module = "te._native", frozen)]
struct AbortOnCancel(Mutex<Option<tokio::task::JoinHandle<()>>>);

#[pymethods]
impl AbortOnCancel {
    fn __call__(&self, fut: &Bound<'_, PyAny>) -> PyResult<()> {
        let task = self.0.lock().take();
        if let Some(task) = task {
            if fut.call_method0("cancelled")?.is_truthy()? {
                task.abort();
            }
        }
        Ok(())
    }
}
