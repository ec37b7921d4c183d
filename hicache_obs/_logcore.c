/* The event log's append path in C: hicache_obs.events._log.EventLog subclasses LogCore.
 *
 * LogCore.emit(cls, /, **fields) does what EventLog.emit documents, without building a
 * keyword dict and without a Python frame:
 *
 *   - refuse a header field (seq, ts_ns, rank) among the fields, with a TypeError;
 *   - take the log's lock (the Python RLock EventLog's other methods take);
 *   - build the event with cls(**fields, seq=, ts_ns=time.time_ns(), rank=), through
 *     vectorcall; a failed construction spends no seq, and a class that emitted while it
 *     was built (taking this seq) is a RuntimeError rather than two events with one seq;
 *   - append it to the retained deque, wait for room in every blocking sink runner,
 *     store it in the ring and publish it to the sink runners;
 *   - deliver it to every subscriber in order; a subscriber that raises an Exception is
 *     reported to EventLog._subscriber_failed(fn, ev, exc) and the rest still run; an
 *     event emitted while subscribers run is queued in _pending and delivered once the
 *     current one reached every subscriber; a BaseException (KeyboardInterrupt) is held
 *     until every queued event reached every subscriber, then raised (log order kept).
 *
 * Stages (EventLog.add_stage; the list bound as `stages`): before the event is stored, each
 * stage is called with it, in order (see run_stages); what they find goes to
 * EventLog._place_findings, which stores the findings before the event and the event with
 * the next seq. Without stages this costs one list-size test.
 *
 * The lock is released on every path out. The header's keyword names are cached per
 * distinct tuple of field names (a bounded cache), so a call site costs one dict lookup.
 *
 * Hand-off (feeders: a sink host's pipe, fed from the producer's own thread, with no worker
 * thread and so no GIL hand-over while the controller runs): once a hand-off callable is
 * set, the outermost publish calls it as handoff(start, events) with the ring's events
 * [handoff_next, published) when `batch` of them wait or `interval` passed since the last
 * hand-off (CLOCK_MONOTONIC), under the log's lock. _handoff_now() does it at once (flush, close);
 * _wait_handoff() lets a watcher thread sleep without the GIL until a hand-off is due
 * while the producer is idle (or a stop fd is readable, or an out fd writable).
 *
 * gap_free_run(events) is the check a replay makes of every segment it reads (see below).
 *
 * What Python can change under it is checked where it is used: the ring's length (bound
 * once, looked at before every store and hand-off), _seq and published (set only within
 * range: no wrap at 2^63, never published beyond what was spent), _publish (only the seq
 * just spent), the built event (it must carry the seq it was stamped with).
 *
 * After _close() (EventLog.close, under the lock) the sinks have their stopping point,
 * closed_at: an event appended later is still a log event (seq, retained, delivered to the
 * subscribers: the in-memory log and its folds stay exact) but is not stored in the ring
 * (`published` stays at closed_at: a runner still reading what came before finds it
 * intact), is not handed off, waits for no runner, and is counted in _after_close; the
 * first one is reported to EventLog._appended_after_close(ev).
 *
 * An optional accelerator (hicache_obs/_native.py) of its pure twin
 * hicache_obs/events/_logcore_py.py (tests/native/test_differential_logcore.py), needed for
 * the bench's events.append_per_s target (the pure twin, HICACHE_OBS_NO_EXTENSIONS=logcore,
 * does not reach it; `hicache-obs bench --section events` measures both).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <time.h>

#define MAX_CACHED_NAMES 4096
#define STACK_ARGS 24

typedef struct {
    PyObject_HEAD
    long long seq;       /* the next seq to hand out */
    long long published; /* events stored in the ring; sink runners read seqs below it */
    char dispatching;    /* subscribers are running (an emit from one is queued); T_BOOL is a char */
    char closed;         /* _close() ran: later events reach no sink (counted in after_close) */
    long long closed_at; /* `published` when _close() ran: the sinks' stopping point */
    long long after_close; /* events appended after _close() */
    Py_ssize_t ring_size; /* the ring's length when bound: checked before every store into it */
    PyObject *rank;
    PyObject *ring;        /* list, its length a power of two */
    PyObject *events_append;
    PyObject *subscribers; /* list */
    PyObject *blocking;    /* list of runners with wait_for_room() */
    PyObject *pending;     /* deque */
    PyObject *stages;      /* list of stage(ev) -> findings, or NULL (see run_stages) */
    PyObject *acquire, *release;
    /* the hand-off (see the top); the long longs are read without the GIL by _wait_handoff */
    PyObject *handoff;           /* callable(start, events), or NULL */
    long long handoff_next;      /* the first seq not handed off yet */
    long long handoff_batch;     /* hand off once this many wait */
    long long handoff_interval;  /* ... or once this long (ns) passed since the last one */
    long long handoff_last;      /* CLOCK_MONOTONIC ns of the last hand-off (or of the set) */
    char handoff_on;             /* a hand-off is set */
    char handoff_busy;           /* the hand-off runs: no nested one */
} LogCore;

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_ACQUIRE)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELEASE)

static long long mono_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static PyObject *names_cache;  /* tuple of field names -> the same + ("seq", "ts_ns", "rank") */
static PyObject *header_names; /* ("seq", "ts_ns", "rank") */
static PyObject *str_seq, *str_rank;
static PyObject *str_append, *str_acquire, *str_release, *str_wait_for_room, *str_failed, *str_popleft, *str_name,
    *str_after_close, *str_place;

static int core_traverse(LogCore *self, visitproc visit, void *arg) {
    Py_VISIT(self->rank);
    Py_VISIT(self->ring);
    Py_VISIT(self->events_append);
    Py_VISIT(self->subscribers);
    Py_VISIT(self->blocking);
    Py_VISIT(self->pending);
    Py_VISIT(self->stages);
    Py_VISIT(self->acquire);
    Py_VISIT(self->release);
    Py_VISIT(self->handoff);
    return 0;
}

static int core_clear(LogCore *self) {
    Py_CLEAR(self->release); /* first: emit() refuses to run without it */
    Py_CLEAR(self->rank);
    Py_CLEAR(self->ring);
    Py_CLEAR(self->events_append);
    Py_CLEAR(self->subscribers);
    Py_CLEAR(self->blocking);
    Py_CLEAR(self->pending);
    Py_CLEAR(self->stages);
    Py_CLEAR(self->acquire);
    STORE(self->handoff_on, 0);
    Py_CLEAR(self->handoff);
    self->ring_size = 0;
    return 0;
}

static void core_dealloc(LogCore *self) {
    PyObject_GC_UnTrack(self);
    core_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *core_bind(LogCore *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ring", "events", "subscribers", "blocking", "pending", "lock", "stages", NULL};
    PyObject *ring, *events, *subscribers, *blocking, *pending, *lock, *stages = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OO!O!OO|O:_bind", kwlist, &PyList_Type, &ring, &events,
                                     &PyList_Type, &subscribers, &PyList_Type, &blocking, &pending, &lock, &stages))
        return NULL;
    if (stages != Py_None && !PyList_Check(stages)) {
        PyErr_Format(PyExc_TypeError, "_bind() argument 'stages' must be list or None, not %.100s",
                     Py_TYPE(stages)->tp_name);
        return NULL;
    }
    if (self->dispatching || self->handoff_busy) {
        PyErr_SetString(PyExc_RuntimeError, "_bind() while the log delivers events");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ring);
    if (n < 1 || (n & (n - 1))) {
        PyErr_Format(PyExc_ValueError, "the ring's length must be a power of two, got %zd", n);
        return NULL;
    }
    PyObject *events_append = PyObject_GetAttr(events, str_append);
    PyObject *acquire = events_append ? PyObject_GetAttr(lock, str_acquire) : NULL;
    PyObject *release = acquire ? PyObject_GetAttr(lock, str_release) : NULL;
    if (!release) {
        Py_XDECREF(events_append);
        Py_XDECREF(acquire);
        return NULL;
    }
    Py_XSETREF(self->events_append, events_append);
    Py_XSETREF(self->acquire, acquire);
    Py_XSETREF(self->release, release);
    Py_INCREF(ring);
    Py_XSETREF(self->ring, ring);
    self->ring_size = n;
    Py_INCREF(subscribers);
    Py_XSETREF(self->subscribers, subscribers);
    Py_INCREF(blocking);
    Py_XSETREF(self->blocking, blocking);
    Py_INCREF(pending);
    Py_XSETREF(self->pending, pending);
    if (stages == Py_None)
        Py_CLEAR(self->stages);
    else {
        Py_INCREF(stages);
        Py_XSETREF(self->stages, stages);
    }
    Py_RETURN_NONE;
}

/* The cached keyword names for these field names, or NULL with an exception set. Borrowed. */
static PyObject *full_names(PyObject *cls, PyObject *kwnames) {
    PyObject *key = kwnames ? kwnames : PyTuple_New(0);
    if (!key)
        return NULL;
    PyObject *full = PyDict_GetItemWithError(names_cache, key);
    if (full || PyErr_Occurred())
        goto done;
    Py_ssize_t k = PyTuple_GET_SIZE(key);
    for (Py_ssize_t i = 0; i < k; i++) {
        int hit = PySequence_Contains(header_names, PyTuple_GET_ITEM(key, i));
        if (hit < 0)
            goto done;
        if (hit) {
            PyObject *sorted = PySequence_List(key);
            if (sorted && PyList_Sort(sorted) == 0) {
                PyObject *name = PyObject_GetAttr(cls, str_name);
                if (!name) {
                    PyErr_Clear();
                    name = PyObject_Repr(cls);
                }
                if (name)
                    PyErr_Format(PyExc_TypeError, "emit(%U, ...) stamps seq, ts_ns and rank itself; got %R", name,
                                 sorted);
                Py_XDECREF(name);
            }
            Py_XDECREF(sorted);
            goto done;
        }
    }
    PyObject *made = PySequence_Concat(key, header_names);
    if (!made)
        goto done;
    if (PyDict_GET_SIZE(names_cache) >= MAX_CACHED_NAMES)
        PyDict_Clear(names_cache); /* field sets built on the fly: start over rather than grow */
    if (PyDict_SetItem(names_cache, key, made) < 0) {
        Py_DECREF(made);
        goto done;
    }
    Py_DECREF(made);
    full = made; /* the cache holds it */
done:
    if (!kwnames)
        Py_DECREF(key);
    return full;
}

/* Release the lock, keeping any exception already set. */
static int unlock(LogCore *self) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyObject *r = PyObject_CallNoArgs(self->release);
    if (!r) {
        if (t) /* the first error wins */
            PyErr_Clear();
        else
            return -1;
    }
    Py_XDECREF(r);
    PyErr_Restore(t, v, tb);
    return t ? -1 : 0;
}

/* 0 when the ring still has the length it was bound with (its mask is what every store
 * and read of it uses); else -1 with a RuntimeError. Python code can clear or grow the
 * list (log._ring.clear()): it is looked at before every store into it. */
static int ring_ok(LogCore *self) {
    if (self->ring && PyList_GET_SIZE(self->ring) == self->ring_size && self->ring_size > 0)
        return 0;
    PyErr_Format(PyExc_RuntimeError, "the log's ring was resized: %zd slots, bound with %zd; the event is not stored",
                 self->ring ? PyList_GET_SIZE(self->ring) : (Py_ssize_t)0, self->ring_size);
    return -1;
}

/* The first BaseException (KeyboardInterrupt, SystemExit, or a failing
 * _subscriber_failed) met while delivering: kept in *held, later ones dropped. Delivery
 * goes on, so every subscriber still sees every event in log order; the publish that
 * started the delivery raises it once the queue is drained. */
static void hold_error(PyObject **held) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb && v)
        PyException_SetTraceback(v, tb);
    Py_XDECREF(t);
    Py_XDECREF(tb);
    if (*held || !v)
        Py_XDECREF(v);
    else
        *held = v;
}

/* The Exception that `fn` raised on `ev` (set, and an Exception) goes to
 * EventLog._subscriber_failed(fn, ev, exc); returns its result (NULL: that raised too). */
static PyObject *report_failure(LogCore *self, PyObject *fn, PyObject *ev) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb)
        PyException_SetTraceback(v, tb);
    PyObject *r = PyObject_CallMethodObjArgs((PyObject *)self, str_failed, fn, ev, v, NULL);
    Py_XDECREF(t);
    Py_XDECREF(v);
    Py_XDECREF(tb);
    return r;
}

/* Hand one event to every subscriber, in order. A subscriber that raises an Exception is
 * reported to EventLog._subscriber_failed(fn, ev, exc) and the rest still run; anything
 * else (KeyboardInterrupt) is held in *held (see hold_error) and the rest still run. */
static void deliver(LogCore *self, PyObject *ev, PyObject **held) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(self->subscribers); i++) {
        PyObject *fn = PyList_GET_ITEM(self->subscribers, i);
        Py_INCREF(fn);
        PyObject *r = PyObject_CallOneArg(fn, ev);
        if (!r) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                hold_error(held);
                Py_DECREF(fn);
                continue;
            }
            r = report_failure(self, fn, ev);
            if (!r) {
                hold_error(held);
                Py_DECREF(fn);
                continue;
            }
        }
        Py_DECREF(r);
        Py_DECREF(fn);
    }
}

/* Hand the events [handoff_next, published) to the hand-off callable, as
 * handoff(start, events). The caller holds the lock. Events the ring no longer holds are
 * skipped (start then lies above what the receivers took: they count the gap as lost).
 * -1 when the callable raised (receivers catch their own errors: only a
 * BaseException gets here). */
static int handoff_run(LogCore *self) {
    if (!self->handoff || self->handoff_busy)
        return 0;
    long long start = self->handoff_next, end = self->published;
    if (self->closed && end > self->closed_at) /* what came after close() goes to no receiver */
        end = self->closed_at;
    if (end <= start)
        return 0;
    if (ring_ok(self) < 0)
        return -1;
    Py_ssize_t size = self->ring_size;
    if (end - start > size)
        start = end - size;
    PyObject *batch = PyList_New((Py_ssize_t)(end - start));
    if (!batch)
        return -1;
    for (long long s = start; s < end; s++) {
        PyObject *ev = PyList_GET_ITEM(self->ring, (Py_ssize_t)(s & (long long)(size - 1)));
        Py_INCREF(ev);
        PyList_SET_ITEM(batch, (Py_ssize_t)(s - start), ev);
    }
    PyObject *start_obj = PyLong_FromLongLong(start);
    if (!start_obj) {
        Py_DECREF(batch);
        return -1;
    }
    STORE(self->handoff_next, end); /* taken, whatever the callable does with them */
    STORE(self->handoff_last, mono_ns());
    PyObject *fn = self->handoff;
    Py_INCREF(fn);
    self->handoff_busy = 1;
    PyObject *r = PyObject_CallFunctionObjArgs(fn, start_obj, batch, NULL);
    self->handoff_busy = 0;
    Py_DECREF(fn);
    Py_DECREF(start_obj);
    Py_DECREF(batch);
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Store event `seq` (its seq already spent): the retained deque, room in every blocking
 * runner, the ring, `published`; then deliver it, or queue it when subscribers are
 * running (an emit from one of them), and deliver what was queued meanwhile. The caller
 * holds the lock. Shared by emit() and EventLog.append().
 *
 * Once the seq is spent the event reaches the ring whatever fails before: a step that
 * raises (a KeyboardInterrupt from a signal handler inside a blocking runner's
 * wait_for_room, a full retained deque's MemoryError) is raised after the store, and the
 * event is then not delivered to subscribers. Without the store, a later event would
 * publish past an empty slot, and the sinks would read it. */
static int publish(LogCore *self, PyObject *ev, long long seq) {
    int failed = 0;
    PyObject *r = PyObject_CallOneArg(self->events_append, ev);
    if (!r)
        failed = 1;
    else
        Py_DECREF(r);
    const int closed = self->closed;
    if (!failed && closed && ++self->after_close == 1) {
        r = PyObject_CallMethodOneArg((PyObject *)self, str_after_close, ev);
        if (!r)
            failed = 1;
        else
            Py_DECREF(r);
    }
    for (Py_ssize_t i = 0; !failed && !closed && i < PyList_GET_SIZE(self->blocking); i++) {
        PyObject *runner = PyList_GET_ITEM(self->blocking, i);
        Py_INCREF(runner);
        r = PyObject_CallMethodNoArgs(runner, str_wait_for_room);
        Py_DECREF(runner);
        if (!r)
            failed = 1;
        else
            Py_DECREF(r);
    }
    /* after close() the ring is left alone: a runner still taking what came before would
     * find it overwritten; `published` stays at closed_at */
    if (!closed) {
        PyObject *et = NULL, *evalue = NULL, *tb = NULL;
        if (failed)
            PyErr_Fetch(&et, &evalue, &tb); /* raised again once the event is stored */
        if (ring_ok(self) < 0) { /* wait_for_room runs Python code */
            if (failed) {
                PyErr_Clear();
                PyErr_Restore(et, evalue, tb);
            }
            return -1;
        }
        Py_ssize_t slot = (Py_ssize_t)(seq & (long long)(self->ring_size - 1));
        PyObject *old = PyList_GET_ITEM(self->ring, slot);
        Py_INCREF(ev);
        PyList_SET_ITEM(self->ring, slot, ev);
        Py_XDECREF(old);
        if (self->published < seq + 1) /* never backwards, whatever ran in between */
            STORE(self->published, seq + 1);
        if (failed) {
            PyErr_Restore(et, evalue, tb);
            return -1;
        }
    } else if (failed) {
        return -1;
    }
    if (self->dispatching) {
        r = PyObject_CallMethodOneArg(self->pending, str_append, ev);
        if (!r)
            return -1;
        Py_DECREF(r);
        return 0;
    }
    self->dispatching = 1;
    PyObject *held = NULL; /* a KeyboardInterrupt from a subscriber: raised once all is delivered */
    int rc = 0;
    deliver(self, ev, &held);
    for (;;) { /* what subscribers emitted, in log order, after the current event */
        Py_ssize_t waiting = PyObject_Size(self->pending);
        if (waiting <= 0) {
            rc = waiting < 0 ? -1 : 0;
            break;
        }
        PyObject *next = PyObject_CallMethodNoArgs(self->pending, str_popleft);
        if (!next) {
            rc = -1;
            break;
        }
        deliver(self, next, &held);
        Py_DECREF(next);
    }
    self->dispatching = 0;
    if (held) {
        if (rc == 0)
            PyErr_SetObject((PyObject *)Py_TYPE(held), held);
        Py_DECREF(held);
        rc = -1;
    }
    if (rc == 0 && self->handoff && !self->handoff_busy && !self->closed) {
        long long waiting = self->published - self->handoff_next;
        if (waiting >= self->handoff_batch ||
            (waiting > 0 && mono_ns() - self->handoff_last >= self->handoff_interval))
            rc = handoff_run(self);
    }
    return rc;
}

/* EventLog.append's store: the event's seq is the one the caller just spent, under the lock. */
static PyObject *core_publish(LogCore *self, PyObject *ev) {
    if (!self->release) {
        PyErr_SetString(PyExc_RuntimeError, "append() on an EventLog whose __init__ did not run");
        return NULL;
    }
    PyObject *seq_obj = PyObject_GetAttr(ev, str_seq);
    if (!seq_obj)
        return NULL;
    int overflow = 0;
    long long seq = PyLong_Check(seq_obj) ? PyLong_AsLongLongAndOverflow(seq_obj, &overflow) : -1;
    if (seq == -1 && PyErr_Occurred()) {
        Py_DECREF(seq_obj);
        return NULL;
    }
    /* only the seq the caller just spent, not yet stored: anything else would move
     * `published` past events that do not exist, or store one twice */
    if (overflow || seq != self->seq - 1 || seq < self->published) {
        PyErr_Format(PyExc_ValueError,
                     "_publish(): the event's seq must be the one just spent (%lld, %lld published), got %R",
                     self->seq - 1, self->published, seq_obj);
        Py_DECREF(seq_obj);
        return NULL;
    }
    Py_DECREF(seq_obj);
    if (ring_ok(self) < 0)
        return NULL;
    if (publish(self, ev, seq) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* 0 when the built event carries the seq it was given (an int), else -1 with a TypeError:
 * a class that returns None, or an object without the header, is no event of this log. */
static int stamped(PyObject *ev, long long seq) {
    PyObject *got = PyObject_GetAttr(ev, str_seq);
    if (got && PyLong_CheckExact(got)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(got, &overflow);
        if (v == seq && !overflow) {
            Py_DECREF(got);
            return 0;
        }
    }
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError,
                 "emit(): the event class returned %.100s whose seq is %R, not the seq %lld it was given; "
                 "it is not appended (no seq spent)",
                 Py_TYPE(ev)->tp_name, got ? got : Py_None, seq);
    Py_XDECREF(got);
    return -1;
}

/* Run the log's stages on `ev` (built with seq `seq`, not stored; the lock held). A stage
 * that raises an Exception is reported to _subscriber_failed(stage, ev, exc) and the event
 * goes on; anything else it raises is returned as an error (nothing stored). What the
 * stages found, [(stage, findings), ...] for each that returned something true, goes to
 * EventLog._place_findings(ev, found), which stores the findings and then the event
 * (re-stamped) and returns it: *out is then the stored event (a new reference). Returns
 * 1 when the stages found nothing (the caller stores ev), 0 when _place_findings stored
 * it, -1 on error. A stage that emitted into the log is an error: the seqs moved. */
static int run_stages(LogCore *self, PyObject *ev, long long seq, PyObject **out) {
    PyObject *found = NULL;
    for (Py_ssize_t i = 0; self->stages && i < PyList_GET_SIZE(self->stages); i++) {
        PyObject *stage = PyList_GET_ITEM(self->stages, i);
        Py_INCREF(stage);
        PyObject *r = PyObject_CallOneArg(stage, ev);
        if (!r) {
            r = PyErr_ExceptionMatches(PyExc_Exception) ? report_failure(self, stage, ev) : NULL;
            if (!r) {
                Py_DECREF(stage);
                Py_XDECREF(found);
                return -1;
            }
            Py_DECREF(r);
            Py_DECREF(stage);
            continue;
        }
        int truth = r == Py_None ? 0 : PyObject_IsTrue(r);
        if (truth > 0) {
            PyObject *pair = PyTuple_Pack(2, stage, r);
            if (!found)
                found = PyList_New(0);
            if (!pair || !found || PyList_Append(found, pair) < 0)
                truth = -1;
            Py_XDECREF(pair);
        }
        Py_DECREF(r);
        Py_DECREF(stage);
        if (truth < 0) {
            Py_XDECREF(found);
            return -1;
        }
    }
    if (self->seq != seq) {
        Py_XDECREF(found);
        PyErr_Format(PyExc_RuntimeError,
                     "emit(): a stage emitted into the log while it looked at %.100s seq %lld; a stage returns its "
                     "findings instead. This event is not appended",
                     Py_TYPE(ev)->tp_name, seq);
        return -1;
    }
    if (!found)
        return 1;
    *out = PyObject_CallMethodObjArgs((PyObject *)self, str_place, ev, found, NULL);
    Py_DECREF(found);
    return *out ? 0 : -1;
}

static PyObject *core_emit(LogCore *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1) {
        PyErr_Format(PyExc_TypeError, "emit() takes the event class as its only positional argument, got %zd",
                     nargs);
        return NULL;
    }
    if (!self->release) {
        PyErr_SetString(PyExc_RuntimeError, "emit() on an EventLog whose __init__ did not run");
        return NULL;
    }
    PyObject *cls = args[0];
    PyObject *names = full_names(cls, kwnames);
    if (!names)
        return NULL;
    Py_ssize_t k = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *small[STACK_ARGS];
    PyObject **stack = small;
    if (k + 3 > STACK_ARGS) {
        stack = PyMem_Malloc((size_t)(k + 3) * sizeof(PyObject *));
        if (!stack)
            return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < k; i++)
        stack[i] = args[1 + i];
    Py_INCREF(names); /* a concurrent cache clear must not free it under the call */

    PyObject *ev = NULL, *seq_obj = NULL, *ts_obj = NULL;
    PyObject *r = PyObject_CallNoArgs(self->acquire);
    if (!r)
        goto out;
    Py_DECREF(r);

    if (ring_ok(self) < 0) {
        unlock(self);
        goto out;
    }
    long long seq = self->seq;
    if (seq < 0 || seq == LLONG_MAX) { /* _seq is checked when set; this is the end of the seq space */
        PyErr_Format(PyExc_OverflowError, "emit(): the log's seq space is spent (next seq %lld)", seq);
        unlock(self);
        goto out;
    }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    seq_obj = PyLong_FromLongLong(seq);
    ts_obj = seq_obj ? PyLong_FromLongLong((long long)now.tv_sec * 1000000000LL + now.tv_nsec) : NULL;
    if (!ts_obj) {
        unlock(self);
        goto out;
    }
    stack[k] = seq_obj;
    stack[k + 1] = ts_obj;
    stack[k + 2] = self->rank ? self->rank : Py_None;
    ev = PyObject_Vectorcall(cls, stack, 0, names);
    if (!ev) { /* no seq spent */
        unlock(self);
        goto out;
    }
    if (self->seq != seq) { /* the class emitted while it was built: two events would share a seq */
        Py_CLEAR(ev);
        PyErr_Format(PyExc_RuntimeError,
                     "emit(): building the event took seq %lld for another event (the event class emitted one); "
                     "this event is not appended",
                     seq);
        unlock(self);
        goto out;
    }
    if (stamped(ev, seq) < 0) { /* a class that returned a non-event, or ignored the seq: nothing spent */
        Py_CLEAR(ev);
        unlock(self);
        goto out;
    }
    if (self->stages && PyList_GET_SIZE(self->stages) > 0) {
        PyObject *stored = NULL;
        int st = run_stages(self, ev, seq, &stored);
        if (st <= 0) { /* stored by _place_findings (findings first), or an error: nothing more here */
            Py_SETREF(ev, stored);
            if (unlock(self) < 0) /* keeps the error of run_stages, if any */
                Py_CLEAR(ev);
            goto out;
        }
    }
    self->seq = seq + 1;
    if (publish(self, ev, seq) < 0)
        goto fail_locked;
    if (unlock(self) < 0)
        Py_CLEAR(ev);
    goto out;
fail_locked:
    Py_CLEAR(ev);
    unlock(self);
out:
    Py_XDECREF(seq_obj);
    Py_XDECREF(ts_obj);
    Py_DECREF(names);
    if (stack != small)
        PyMem_Free(stack);
    return ev;
}

/* _set_handoff(fn, next, batch, interval): hand events from seq `next` on to fn(start,
 * events) every `batch` events or `interval` seconds; fn None stops handing off. */
static PyObject *core_set_handoff(LogCore *self, PyObject *args) {
    PyObject *fn;
    long long next, batch;
    double interval;
    if (!PyArg_ParseTuple(args, "OLLd:_set_handoff", &fn, &next, &batch, &interval))
        return NULL;
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_Format(PyExc_TypeError, "_set_handoff(): the hand-off must be callable or None, got %.100s",
                     Py_TYPE(fn)->tp_name);
        return NULL;
    }
    if (!self->ring) {
        PyErr_SetString(PyExc_RuntimeError, "_set_handoff() on an EventLog whose __init__ did not run");
        return NULL;
    }
    if (batch < 1 || batch > PyList_GET_SIZE(self->ring) / 2) {
        PyErr_Format(PyExc_ValueError, "hand-off batch must be between 1 and half the ring (%zd), got %lld",
                     PyList_GET_SIZE(self->ring) / 2, batch);
        return NULL;
    }
    if (!(interval > 0 && interval < 1e6)) {
        PyErr_Format(PyExc_ValueError, "hand-off interval must be above 0 seconds (and sane), got %R",
                     PyTuple_GET_ITEM(args, 3));
        return NULL;
    }
    if (next < 0) {
        PyErr_Format(PyExc_ValueError, "hand-off start must be a seq >= 0, got %lld", next);
        return NULL;
    }
    STORE(self->handoff_on, 0);
    if (fn == Py_None) {
        Py_CLEAR(self->handoff);
        Py_RETURN_NONE;
    }
    Py_INCREF(fn);
    Py_XSETREF(self->handoff, fn);
    self->handoff_batch = batch;
    self->handoff_interval = (long long)(interval * 1e9);
    STORE(self->handoff_next, next);
    STORE(self->handoff_last, mono_ns());
    STORE(self->handoff_on, 1);
    Py_RETURN_NONE;
}

/* _handoff_now(): hand off whatever waits, now (the caller holds the lock). */
static PyObject *core_handoff_now(LogCore *self, PyObject *Py_UNUSED(arg)) {
    if (handoff_run(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* _wait_handoff(timeout, stop_fd, out_fd) -> 0 timed out, 1 a hand-off is due (events
 * wait and `interval` passed since the last hand-off: the producer went idle), 2 out_fd is writable (or
 * broken: the write says which), 3 stop_fd is readable. Sleeps without the GIL: a watcher
 * of an idle producer, which costs a busy producer nothing. out_fd -1: none. */
static PyObject *core_wait_handoff(LogCore *self, PyObject *args) {
    double timeout;
    int stop_fd, out_fd;
    if (!PyArg_ParseTuple(args, "dii:_wait_handoff", &timeout, &stop_fd, &out_fd))
        return NULL;
    if (!(timeout >= 0 && timeout < 1e6)) {
        PyErr_Format(PyExc_ValueError, "_wait_handoff(): timeout must be >= 0 seconds, got %R", PyTuple_GET_ITEM(args, 0));
        return NULL;
    }
    long long deadline = mono_ns() + (long long)(timeout * 1e9);
    int code = 0, err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        long long now = mono_ns();
        long long interval = LOAD(self->handoff_interval);
        long long end = LOAD(self->published);
        if (LOAD(self->closed) && end > LOAD(self->closed_at))
            end = LOAD(self->closed_at);
        long long waiting = LOAD(self->handoff_on) ? end - LOAD(self->handoff_next) : 0;
        long long due = LOAD(self->handoff_last) + interval;
        if (waiting > 0 && now >= due) {
            code = 1;
            break;
        }
        if (now >= deadline)
            break;
        long long wait = deadline - now;
        long long look = waiting > 0 ? due - now : interval; /* nothing waits: look again later */
        if (look > 0 && look < wait)
            wait = look;
        struct pollfd fds[2] = {{stop_fd, POLLIN, 0}, {out_fd, POLLOUT, 0}};
        int n = poll(fds, out_fd >= 0 ? 2 : 1, (int)((wait + 999999) / 1000000));
        if (n < 0) {
            if (errno == EINTR)
                continue;
            err = errno;
            break;
        }
        if (n > 0 && fds[0].revents) {
            code = 3;
            break;
        }
        if (n > 0 && out_fd >= 0 && fds[1].revents) {
            code = 2;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(code);
}

/* _close(): the sinks stop at what is published now; later events reach none (see the top). */
static PyObject *core_close(LogCore *self, PyObject *Py_UNUSED(arg)) {
    if (!self->closed) {
        STORE(self->closed_at, self->published);
        STORE(self->closed, 1);
    }
    Py_RETURN_NONE;
}

static PyMethodDef core_methods[] = {
    {"_close", (PyCFunction)core_close, METH_NOARGS,
     "Stop the sinks at what is published now: later events reach none, counted (the caller holds the lock)."},
    {"_set_handoff", (PyCFunction)core_set_handoff, METH_VARARGS,
     "_set_handoff(fn, next, batch, interval): hand events from seq next on to fn(start, events)."},
    {"_handoff_now", (PyCFunction)core_handoff_now, METH_NOARGS,
     "Hand off whatever waits, now (the caller holds the log's lock)."},
    {"_wait_handoff", (PyCFunction)core_wait_handoff, METH_VARARGS,
     "_wait_handoff(timeout, stop_fd, out_fd) -> 0 timeout, 1 due, 2 out_fd writable, 3 stop_fd readable."},
    {"emit", (PyCFunction)(void (*)(void))core_emit, METH_FASTCALL | METH_KEYWORDS,
     "emit(cls, /, **fields)\n--\n\nCreate, append and deliver one event of type ``cls``."},
    {"_publish", (PyCFunction)core_publish, METH_O,
     "Store and deliver an event whose seq the caller (EventLog.append, holding the lock) just spent."},
    {"_bind", (PyCFunction)(void (*)(void))core_bind, METH_VARARGS | METH_KEYWORDS,
     "Give the core the log's ring, retained deque, subscribers, blocking runners, pending deque, lock and "
     "(optional) stages."},
    {NULL, NULL, 0, NULL},
};

/* _seq and published are set from Python (EventLog.__init__, EventLog.append): a value
 * the C side cannot live with (a negative seq, one at the end of the seq space, events
 * published that were never spent) is refused here, not met later. */
static int set_counter(PyObject *value, const char *what, long long lo, long long hi, long long *out) {
    if (!value) {
        PyErr_Format(PyExc_AttributeError, "%s cannot be deleted", what);
        return -1;
    }
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", what, Py_TYPE(value)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "%s must be in %lld..%lld, got %R", what, lo, hi, value);
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *core_get_seq(LogCore *self, void *Py_UNUSED(c)) { return PyLong_FromLongLong(self->seq); }
static int core_set_seq(LogCore *self, PyObject *value, void *Py_UNUSED(c)) {
    /* never below what is published (those seqs are taken), never LLONG_MAX (seq + 1 must exist) */
    return set_counter(value, "_seq", self->published, LLONG_MAX - 1, &self->seq);
}
static PyObject *core_get_published(LogCore *self, void *Py_UNUSED(c)) {
    return PyLong_FromLongLong(self->published);
}
static int core_set_published(LogCore *self, PyObject *value, void *Py_UNUSED(c)) {
    long long v;
    if (set_counter(value, "published", 0, self->seq, &v) < 0)
        return -1;
    STORE(self->published, v);
    return 0;
}

static PyGetSetDef core_getset[] = {
    {"_seq", (getter)core_get_seq, (setter)core_set_seq, "the next seq to hand out", NULL},
    {"published", (getter)core_get_published, (setter)core_set_published,
     "events stored in the ring; sink runners read seqs below it", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef core_members[] = {
    {"_dispatching", T_BOOL, offsetof(LogCore, dispatching), READONLY, "subscribers are running"},
    {"_closed", T_BOOL, offsetof(LogCore, closed), READONLY, "_close() ran: later events reach no sink"},
    {"_closed_at", T_LONGLONG, offsetof(LogCore, closed_at), READONLY, "published when _close() ran"},
    {"_after_close", T_LONGLONG, offsetof(LogCore, after_close), READONLY, "events appended after _close()"},
    {"rank", T_OBJECT, offsetof(LogCore, rank), 0, "the rank stamped on every event"},
    {"_handoff_next", T_LONGLONG, offsetof(LogCore, handoff_next), READONLY, "the first seq not handed off yet"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject LogCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hicache_obs._logcore.LogCore",
    .tp_basicsize = sizeof(LogCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The event log's append path (see hicache_obs/_logcore.c).",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_methods = core_methods,
    .tp_members = core_members,
    .tp_getset = core_getset,
};

/* gap_free_run(events): (rank, first seq) when the list's events are one rank's seqs
 * first, first + 1, ... in order; None otherwise (or when the list is empty). What a
 * replay checks of every segment it reads, without a Python loop. */
static PyObject *gap_free_run(PyObject *Py_UNUSED(mod), PyObject *events) {
    if (!PyList_Check(events)) {
        PyErr_Format(PyExc_TypeError, "gap_free_run() takes a list of events, got %.100s", Py_TYPE(events)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(events);
    if (n == 0)
        Py_RETURN_NONE;
    PyObject *rank0 = NULL, *first_obj = NULL, *out = NULL;
    long long first = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        Py_INCREF(ev);
        PyObject *seq = PyObject_GetAttr(ev, str_seq);
        PyObject *rank = seq ? PyObject_GetAttr(ev, str_rank) : NULL;
        Py_DECREF(ev);
        if (!rank) {
            Py_XDECREF(seq);
            goto done;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(seq, &overflow);
        int same = 0;
        if (!(v == -1 && PyErr_Occurred()) && !overflow) {
            if (i == 0) {
                first = v;
                rank0 = rank;
                first_obj = seq;
                Py_INCREF(rank0);
                Py_INCREF(first_obj);
                same = 1;
            } else {
                same = first <= LLONG_MAX - i && v == first + i /* no overflow at the ends of 64 bits */
                           ? (rank == rank0 ? 1 : PyObject_RichCompareBool(rank, rank0, Py_EQ))
                           : 0;
            }
        }
        Py_DECREF(seq);
        Py_DECREF(rank);
        if (same < 0 || PyErr_Occurred())
            goto done;
        if (!same) {
            out = Py_None;
            Py_INCREF(out);
            goto done;
        }
    }
    out = PyTuple_Pack(2, rank0, first_obj);
done:
    Py_XDECREF(rank0);
    Py_XDECREF(first_obj);
    return out;
}

static PyMethodDef module_methods[] = {
    {"gap_free_run", gap_free_run, METH_O,
     "gap_free_run(events, /)\n--\n\n(rank, first seq) when the events are one rank's gap-free run of seqs in "
     "order; None otherwise."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_logcore", "The event log's append path; the seq check of a replay.", -1,
                                    module_methods};

PyMODINIT_FUNC PyInit__logcore(void) {
    names_cache = PyDict_New();
    PyObject *seq = PyUnicode_InternFromString("seq"), *ts = PyUnicode_InternFromString("ts_ns"),
             *rank = PyUnicode_InternFromString("rank");
    header_names = seq && ts && rank ? PyTuple_Pack(3, seq, ts, rank) : NULL; /* interned, as kwnames are */
    str_seq = seq;
    str_rank = rank;
    Py_XDECREF(ts);
    str_append = PyUnicode_InternFromString("append");
    str_acquire = PyUnicode_InternFromString("acquire");
    str_release = PyUnicode_InternFromString("release");
    str_wait_for_room = PyUnicode_InternFromString("wait_for_room");
    str_failed = PyUnicode_InternFromString("_subscriber_failed");
    str_popleft = PyUnicode_InternFromString("popleft");
    str_name = PyUnicode_InternFromString("__name__");
    str_after_close = PyUnicode_InternFromString("_appended_after_close");
    str_place = PyUnicode_InternFromString("_place_findings");
    if (!names_cache || !header_names || !str_append || !str_acquire || !str_release || !str_wait_for_room ||
        !str_failed || !str_popleft || !str_name || !str_after_close || !str_place)
        return NULL;
    if (PyType_Ready(&LogCoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&LogCoreType);
    if (PyModule_AddObject(m, "LogCore", (PyObject *)&LogCoreType) < 0) {
        Py_DECREF(&LogCoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
