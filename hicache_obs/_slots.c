/* Which slots of a pool are allocated, and the FIFO order of its free pages, in C.
 *
 * hicache_obs.events._state.SlotTable and AllocMap subclass SlotMap. Every allocation
 * and free of a live controller, and of a replayed log, passes through it.
 *
 * SlotMap(capacity, page_size=1, track_pages=True)
 *   alloc[capacity]     one byte per slot: 1 allocated, 0 free
 *   page_used[npages]   allocated slots per page (page_size > 1)
 *   the free list       the FIFO the allocator takes pages from: the never-used pages
 *                       from `fresh` upwards (less the holes: pages above `fresh` taken
 *                       out of order, and those freed again, which are listed below),
 *                       then the freed pages in the order they were freed (a doubly
 *                       linked list over the pages, O(1) removal).
 * Without track_pages only `alloc` exists (what the auditor needs).
 *
 * Runs are ((start, length), ...). A run that lies (partly) out of range, or has a
 * length <= 0, changes nothing and reports a few of its slots; slots that already were
 * in the state asked for are reported and skipped, the others applied.
 *
 * The page arrays are calloc'd: pages never used cost no memory the OS has to back.
 *
 * runs_of / pair_runs_of / side_runs run-length encode index values (lists, or numpy
 * views of index tensors, read in place) into the runs events and copies carry;
 * dlpack_facts reads an index tensor's size, address and value runs from its DLPack
 * capsule in one call (the SGLang adapter's reads, between copies, with cold caches).
 *
 * use_refs / recorded / op_tensors / device_changes / received and RecordObserver are
 * the SGLang adapter's per-submission steps (its hooks' bookkeeping: a submission's
 * tensors, its records, its move, its copies), each a few C calls where it was a dozen
 * Python ones; see each one's comment.
 *
 * An optional accelerator (hicache_obs/_native.py) of its pure twin
 * hicache_obs/events/_slots_py.py (tests/native/test_differential_slots.py), needed for
 * events.replay_audit_per_s and for the footprint of big pools (10 bytes a page here,
 * about 100 a freed page in the twin): replay + audit ran at 0.47 / 0.34 of its floor
 * loop with these maps, 0.23 / 0.25 with the twin (HICACHE_OBS_NO_EXTENSIONS=slots),
 * two alternating runs each of `hicache-obs bench --section events --json` on
 * 2026-12-01, this project's 2-core CPU machine under load from other jobs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define HOLE 1u
#define FREED 2u

typedef struct {
    PyObject_HEAD
    long long capacity, page_size, npages;
    long long used;        /* allocated slots */
    long long fresh;       /* the lowest page never allocated (bar holes) */
    long long n;           /* free pages */
    long long head, tail;  /* freed list, page + 1 (0: empty) */
    long long nholes;
    int track;
    unsigned char *alloc;  /* capacity */
    uint32_t *page_used;   /* npages, page_size > 1 */
    unsigned char *flags;  /* npages: HOLE | FREED */
    uint32_t *next, *prev; /* npages, page + 1 (0: none) */
} SlotMap;

static void release_arrays(SlotMap *self) {
    free(self->alloc);
    free(self->page_used);
    free(self->flags);
    free(self->next);
    free(self->prev);
    self->alloc = NULL;
    self->page_used = NULL;
    self->flags = NULL;
    self->next = self->prev = NULL;
}

static void map_dealloc(SlotMap *self) {
    release_arrays(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int map_init(SlotMap *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacity", "page_size", "track_pages", NULL};
    long long capacity, page_size = 1;
    int track = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|Lp:SlotMap", kwlist, &capacity, &page_size, &track))
        return -1;
    if (capacity < 0 || capacity > (1LL << 31)) {
        PyErr_Format(PyExc_ValueError, "capacity must be in 0..%lld, got %lld", 1LL << 31, capacity);
        return -1;
    }
    if (page_size < 1) {
        PyErr_Format(PyExc_ValueError, "page_size must be >= 1, got %lld", page_size);
        return -1;
    }
    release_arrays(self);
    self->capacity = capacity;
    self->page_size = page_size;
    self->npages = track ? capacity / page_size : 0;
    self->track = track;
    self->used = self->fresh = self->head = self->tail = self->nholes = 0;
    self->n = self->npages;
    size_t np = (size_t)self->npages + 1;
    self->alloc = calloc((size_t)capacity + 1, 1);
    int ok = self->alloc != NULL;
    if (track) {
        self->flags = calloc(np, 1);
        self->next = calloc(np, sizeof(uint32_t));
        self->prev = calloc(np, sizeof(uint32_t));
        ok = ok && self->flags && self->next && self->prev;
        if (page_size > 1) {
            self->page_used = calloc(np, sizeof(uint32_t));
            ok = ok && self->page_used;
        }
    }
    if (!ok) {
        release_arrays(self);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int ready(SlotMap *self) {
    if (!self->alloc) {
        PyErr_SetString(PyExc_RuntimeError, "SlotMap.__init__ did not run");
        return 0;
    }
    return 1;
}

/* ------------------------------------------------------------- free list */
static void unlink_freed(SlotMap *self, long long p) {
    uint32_t nx = self->next[p], pv = self->prev[p];
    if (pv)
        self->next[pv - 1] = nx;
    else
        self->head = nx;
    if (nx)
        self->prev[nx - 1] = pv;
    else
        self->tail = pv;
    self->next[p] = self->prev[p] = 0;
    self->flags[p] &= (unsigned char)~FREED;
}

/* The page at `fresh` was allocated: move past it and past the holes above it. */
static void advance_fresh(SlotMap *self) {
    self->fresh++;
    while (self->nholes && self->fresh < self->npages && (self->flags[self->fresh] & HOLE)) {
        self->flags[self->fresh] &= (unsigned char)~HOLE;
        self->nholes--;
        self->fresh++;
    }
}

/* Page p was allocated: it leaves the free list (nothing if it was not on it). */
static void take(SlotMap *self, long long p) {
    if (p < 0 || p >= self->npages)
        return;
    unsigned char f = self->flags[p];
    if (f & FREED) {
        unlink_freed(self, p);
        self->n--;
        if (p == self->fresh)
            advance_fresh(self);
        else if (p > self->fresh) { /* allocated above the fresh pages again: a hole once more */
            self->flags[p] |= HOLE;
            self->nholes++;
        }
    } else if (p == self->fresh) {
        self->n--;
        advance_fresh(self);
    } else if (p > self->fresh && !(f & HOLE)) {
        self->flags[p] |= HOLE;
        self->nholes++;
        self->n--;
    }
}

/* Page p became free: it joins the back of the list (nothing if it was free). */
static void push(SlotMap *self, long long p) {
    if (p < 0 || p >= self->npages)
        return;
    unsigned char f = self->flags[p];
    if ((f & FREED) || (p >= self->fresh && !(f & HOLE)))
        return;
    if (f & HOLE) {
        self->flags[p] &= (unsigned char)~HOLE;
        self->nholes--;
    }
    self->flags[p] |= FREED;
    self->prev[p] = (uint32_t)self->tail;
    self->next[p] = 0;
    if (self->tail)
        self->next[self->tail - 1] = (uint32_t)(p + 1);
    else
        self->head = p + 1;
    self->tail = p + 1;
    self->n++;
}

/* ------------------------------------------------------------------ runs */
typedef struct {
    long long start, length;
    PyObject *start_obj; /* owned (an int), for reports of runs beyond 64 bits */
    int wide;            /* start or length beyond long long */
} Run;

/* Read one (start, length) pair. The values are turned into ints first (which may run
 * Python code: __index__), holding references, so nothing borrowed can go away. */
static int read_run(PyObject *item, Run *r) {
    r->start_obj = NULL;
    PyObject *pair = PySequence_Tuple(item);
    if (!pair) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "a run is a (start, length) pair, got %R", item);
        }
        return -1;
    }
    if (PyTuple_GET_SIZE(pair) != 2) {
        PyErr_Format(PyExc_TypeError, "a run is a (start, length) pair, got %R", item);
        Py_DECREF(pair);
        return -1;
    }
    PyObject *s = PyNumber_Index(PyTuple_GET_ITEM(pair, 0));
    PyObject *l = s ? PyNumber_Index(PyTuple_GET_ITEM(pair, 1)) : NULL;
    Py_DECREF(pair);
    if (!l) {
        Py_XDECREF(s);
        return -1;
    }
    int o1 = 0, o2 = 0;
    r->start = PyLong_AsLongLongAndOverflow(s, &o1);
    r->length = PyLong_AsLongLongAndOverflow(l, &o2);
    Py_DECREF(l);
    r->start_obj = s;
    r->wide = o1 || o2;
    if (o2)
        r->length = o2 > 0 ? LLONG_MAX : LLONG_MIN;
    return 0;
}

static int in_range(SlotMap *self, Run *r) {
    return !r->wide && r->start >= 0 && r->length > 0 && r->length <= self->capacity - r->start;
}

/* A few slots of a run that lies (partly) outside the table: start + i for i < max(1, min(length, 8)). */
static int report_invalid(PyObject *bad, Run *r) {
    long long k = r->length < 1 ? 1 : (r->length > 8 ? 8 : r->length);
    for (long long i = 0; i < k; i++) {
        PyObject *v;
        if (r->wide || r->start > LLONG_MAX - 8) {
            PyObject *off = PyLong_FromLongLong(i);
            v = off ? PyNumber_Add(r->start_obj, off) : NULL;
            Py_XDECREF(off);
        } else {
            v = PyLong_FromLongLong(r->start + i);
        }
        if (!v || PyList_Append(bad, v) < 0) {
            Py_XDECREF(v);
            return -1;
        }
        Py_DECREF(v);
    }
    return 0;
}

static int append_slot(PyObject *bad, long long s) {
    PyObject *v = PyLong_FromLongLong(s);
    if (!v || PyList_Append(bad, v) < 0) {
        Py_XDECREF(v);
        return -1;
    }
    Py_DECREF(v);
    return 0;
}

typedef int (*run_fn)(SlotMap *, Run *, PyObject *);

static PyObject *each_run(SlotMap *self, PyObject *runs, run_fn fn) {
    if (!ready(self))
        return NULL;
    /* a tuple (the runs events carry are one already): nothing a run's __index__ does can change it */
    PyObject *seq = PyTuple_CheckExact(runs) ? (Py_INCREF(runs), runs) : NULL;
    if (!seq) {
        seq = PySequence_Check(runs) ? PySequence_Tuple(runs) : NULL;
        if (!seq) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_SetString(PyExc_TypeError, "runs must be a sequence of (start, length) pairs");
            }
            return NULL;
        }
    }
    PyObject *bad = PyList_New(0);
    if (!bad) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(seq); i++) {
        Run r;
        int failed = read_run(PyTuple_GET_ITEM(seq, i), &r) < 0 || fn(self, &r, bad) < 0;
        Py_XDECREF(r.start_obj);
        if (failed) {
            Py_DECREF(bad);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return bad;
}

static int alloc_run(SlotMap *self, Run *r, PyObject *bad) {
    if (!in_range(self, r))
        return report_invalid(bad, r);
    long long start = r->start, end = r->start + r->length, ps = self->page_size;
    unsigned char *a = self->alloc;
    int track = self->track;
    if (!memchr(a + start, 1, (size_t)r->length)) { /* the normal case: every slot was free */
        memset(a + start, 1, (size_t)r->length);
        self->used += r->length;
        if (!track)
            return 0;
        if (ps == 1) {
            for (long long p = start; p < end; p++)
                take(self, p);
        } else if (start % ps == 0 && r->length % ps == 0) { /* whole pages */
            for (long long p = start / ps; p < end / ps; p++) {
                self->page_used[p] = (uint32_t)ps;
                take(self, p);
            }
        } else {
            for (long long s = start; s < end; s++) {
                long long p = s / ps;
                if (p < self->npages)
                    self->page_used[p]++;
                take(self, p);
            }
        }
        return 0;
    }
    for (long long s = start; s < end; s++) { /* some slots already allocated: slot by slot */
        if (a[s]) {
            if (append_slot(bad, s) < 0)
                return -1;
            continue;
        }
        a[s] = 1;
        self->used++;
        if (!track)
            continue;
        long long p = s / ps;
        if (ps > 1 && p < self->npages)
            self->page_used[p]++;
        take(self, p);
    }
    return 0;
}

static void free_slot_page(SlotMap *self, long long s) {
    long long ps = self->page_size;
    if (ps == 1) {
        push(self, s);
        return;
    }
    long long p = s / ps;
    if (p < self->npages && self->page_used[p] && --self->page_used[p] == 0)
        push(self, p);
}

static int free_run(SlotMap *self, Run *r, PyObject *bad) {
    if (!in_range(self, r))
        return report_invalid(bad, r);
    long long start = r->start, end = r->start + r->length, ps = self->page_size;
    unsigned char *a = self->alloc;
    int track = self->track;
    if (!memchr(a + start, 0, (size_t)r->length)) { /* the normal case: every slot was allocated */
        memset(a + start, 0, (size_t)r->length);
        self->used -= r->length;
        if (!track)
            return 0;
        if (ps > 1 && start % ps == 0 && r->length % ps == 0) { /* whole pages */
            for (long long p = start / ps; p < end / ps; p++) {
                self->page_used[p] = 0;
                push(self, p);
            }
            return 0;
        }
        for (long long s = start; s < end; s++)
            free_slot_page(self, s);
        return 0;
    }
    for (long long s = start; s < end; s++) {
        if (!a[s]) {
            if (append_slot(bad, s) < 0)
                return -1;
            continue;
        }
        a[s] = 0;
        self->used--;
        if (track)
            free_slot_page(self, s);
    }
    return 0;
}

static int check_run(SlotMap *self, Run *r, PyObject *bad) {
    if (!in_range(self, r))
        return report_invalid(bad, r);
    const unsigned char *a = self->alloc;
    if (!memchr(a + r->start, 0, (size_t)r->length))
        return 0;
    for (long long s = r->start; s < r->start + r->length; s++)
        if (!a[s] && append_slot(bad, s) < 0)
            return -1;
    return 0;
}

static PyObject *map_apply_alloc(SlotMap *self, PyObject *runs) { return each_run(self, runs, alloc_run); }
static PyObject *map_apply_free(SlotMap *self, PyObject *runs) { return each_run(self, runs, free_run); }
static PyObject *map_unallocated(SlotMap *self, PyObject *runs) { return each_run(self, runs, check_run); }

static PyObject *map_is_allocated(SlotMap *self, PyObject *arg) {
    if (!ready(self))
        return NULL;
    int overflow = 0;
    long long s = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (s == -1 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(!overflow && s >= 0 && s < self->capacity && self->alloc[s]);
}

/* The first k pages of the free list, in the order the allocator takes them. */
static PyObject *first_pages(SlotMap *self, long long k) {
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    long long got = 0;
    for (long long p = self->fresh; got < k && p < self->npages; p++) {
        if (self->flags[p] & (HOLE | FREED)) /* taken out of order, or freed after that: listed below */
            continue;
        if (append_slot(out, p) < 0)
            goto fail;
        got++;
    }
    for (long long q = self->head; got < k && q; q = self->next[q - 1]) {
        if (append_slot(out, q - 1) < 0)
            goto fail;
        got++;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *map_peek(SlotMap *self, PyObject *arg) {
    if (!ready(self))
        return NULL;
    if (!self->track) {
        PyErr_SetString(PyExc_TypeError, "peek() needs a SlotMap that tracks pages");
        return NULL;
    }
    if (!PyIndex_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "peek() takes a number of pages (int), got %.100s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    int overflow = 0;
    long long k = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    if (overflow < 0 || (!overflow && k < 0)) {
        PyErr_Format(PyExc_ValueError, "peek of %R pages: the number of pages must be >= 0", arg);
        return NULL;
    }
    if (overflow > 0 || k > self->n) {
        PyErr_Format(PyExc_ValueError, "peek of %R pages with %lld free", arg, self->n);
        return NULL;
    }
    return first_pages(self, k);
}

static PyObject *map_free_order(SlotMap *self, PyObject *Py_UNUSED(ignored)) {
    if (!ready(self))
        return NULL;
    return first_pages(self, self->track ? self->n : 0);
}

/* The allocated slots as ((start, length), ...). */
static PyObject *map_allocated_runs(SlotMap *self, PyObject *Py_UNUSED(ignored)) {
    if (!ready(self))
        return NULL;
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    const unsigned char *a = self->alloc;
    long long cap = self->capacity, s = 0;
    while (s < cap) {
        const unsigned char *hit = memchr(a + s, 1, (size_t)(cap - s));
        if (!hit)
            break;
        long long start = hit - a;
        const unsigned char *gap = memchr(hit, 0, (size_t)(cap - start));
        long long end = gap ? gap - a : cap;
        PyObject *run = Py_BuildValue("(LL)", start, end - start);
        if (!run || PyList_Append(out, run) < 0) {
            Py_XDECREF(run);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(run);
        s = end;
    }
    PyObject *t = PyList_AsTuple(out);
    Py_DECREF(out);
    return t;
}

/* ------------------------------------------------------- run-length encoding */
/* The values of a list/tuple of ints, or of a 1-D integer buffer (a numpy view of an
 * index tensor), read one at a time without building Python ints for the buffer. */
typedef struct {
    PyObject *seq; /* PySequence_Fast result, or NULL for a buffer */
    Py_buffer view;
    int has_view;
    char kind; /* buffer: 'i' signed, 'u' unsigned */
    Py_ssize_t n;
} Values;

static int values_open(Values *v, PyObject *obj, const char *what) {
    memset(v, 0, sizeof(*v));
    if (PyObject_CheckBuffer(obj) && !PyBytes_Check(obj) && !PyByteArray_Check(obj)) {
        if (PyObject_GetBuffer(obj, &v->view, PyBUF_STRIDES | PyBUF_FORMAT) < 0)
            return -1;
        v->has_view = 1;
        const char *f = v->view.format ? v->view.format : "B";
        if (*f == '@' || *f == '=')
            f++;
        int ok = f[0] && !f[1] && v->view.ndim <= 1;
        if (ok && strchr("bhilq", f[0]))
            v->kind = 'i';
        else if (ok && strchr("BHILQ", f[0]))
            v->kind = 'u';
        else {
            PyErr_Format(PyExc_TypeError, "%s: a 1-D buffer of integers is needed, got format %s with %d dimensions",
                         what, v->view.format ? v->view.format : "B", v->view.ndim);
            PyBuffer_Release(&v->view);
            v->has_view = 0;
            return -1;
        }
        v->n = v->view.ndim == 0 ? 1 : v->view.shape[0];
        return 0;
    }
    v->seq = PySequence_Fast(obj, "a sequence of ints or a 1-D integer buffer is needed");
    if (!v->seq)
        return -1;
    v->n = PySequence_Fast_GET_SIZE(v->seq);
    return 0;
}

static void values_close(Values *v) {
    Py_XDECREF(v->seq);
    if (v->has_view)
        PyBuffer_Release(&v->view);
}

static int values_get(Values *v, Py_ssize_t i, long long *out) {
    if (v->seq) {
        if (i >= PySequence_Fast_GET_SIZE(v->seq)) { /* an __index__ shrank the list */
            PyErr_SetString(PyExc_RuntimeError, "the values changed size while they were read");
            return -1;
        }
        PyObject *item = PySequence_Fast_ITEMS(v->seq)[i];
        Py_INCREF(item);
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(item, &overflow);
        Py_DECREF(item);
        if (x == -1 && PyErr_Occurred())
            return -1;
        if (overflow) {
            PyErr_SetString(PyExc_OverflowError, "an index value does not fit in 64 bits");
            return -1;
        }
        *out = x;
        return 0;
    }
    const char *p = (const char *)v->view.buf + (v->view.ndim ? i * v->view.strides[0] : 0);
    Py_ssize_t size = v->view.itemsize;
    /* memcpy: a view need not be aligned */
    if (v->kind == 'i') {
        switch (size) {
        case 1: { int8_t x; memcpy(&x, p, 1); *out = x; return 0; }
        case 2: { int16_t x; memcpy(&x, p, 2); *out = x; return 0; }
        case 4: { int32_t x; memcpy(&x, p, 4); *out = x; return 0; }
        case 8: { int64_t x; memcpy(&x, p, 8); *out = x; return 0; }
        }
    } else {
        switch (size) {
        case 1: { uint8_t x; memcpy(&x, p, 1); *out = x; return 0; }
        case 2: { uint16_t x; memcpy(&x, p, 2); *out = x; return 0; }
        case 4: { uint32_t x; memcpy(&x, p, 4); *out = x; return 0; }
        case 8: {
            uint64_t u;
            memcpy(&u, p, 8);
            if (u > (uint64_t)LLONG_MAX) {
                PyErr_SetString(PyExc_OverflowError, "an index value does not fit in 64 bits");
                return -1;
            }
            *out = (long long)u;
            return 0;
        }
        }
    }
    PyErr_Format(PyExc_TypeError, "integers of %zd bytes are not supported", size);
    return -1;
}

static int follows(long long prev, long long v) { return prev != LLONG_MAX && v == prev + 1; }

static int append_tuple(PyObject *out, PyObject *t) {
    if (!t)
        return -1;
    int r = PyList_Append(out, t);
    Py_DECREF(t);
    return r;
}

static PyObject *list_to_tuple(PyObject *out) {
    if (!out)
        return NULL;
    PyObject *t = PyList_AsTuple(out);
    Py_DECREF(out);
    return t;
}

/* runs_of(values): ((start, length), ...) of consecutive values: [3, 4, 5, 9] -> ((3, 3), (9, 1)). */
static PyObject *runs_of(PyObject *Py_UNUSED(mod), PyObject *obj) {
    Values v;
    if (values_open(&v, obj, "runs_of") < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    long long start = 0, prev = 0, x;
    for (Py_ssize_t i = 0; out && i < v.n; i++) {
        if (values_get(&v, i, &x) < 0)
            goto fail;
        if (i && follows(prev, x)) {
            prev = x;
            continue;
        }
        if (i && append_tuple(out, Py_BuildValue("(LL)", start, prev - start + 1)) < 0)
            goto fail;
        start = prev = x;
    }
    if (out && v.n && append_tuple(out, Py_BuildValue("(LL)", start, prev - start + 1)) < 0)
        goto fail;
    values_close(&v);
    return list_to_tuple(out);
fail:
    Py_XDECREF(out);
    values_close(&v);
    return NULL;
}

/* DLPack's legacy tensor, as an unconsumed "dltensor" capsule holds it (dlpack.h before
 * 1.0; what torch._C._to_dlpack returns). Only read here: the capsule keeps the tensor. */
typedef struct {
    int32_t device_type, device_id;
} DLDeviceV0;
typedef struct {
    uint8_t code, bits;
    uint16_t lanes;
} DLDataTypeV0;
typedef struct {
    void *data;
    DLDeviceV0 device;
    int32_t ndim;
    DLDataTypeV0 dtype;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} DLTensorV0;
typedef struct {
    DLTensorV0 dl_tensor;
    void *manager_ctx;
    void (*deleter)(void *);
} DLManagedTensorV0;

enum { DL_CPU = 1, DL_CUDA_HOST = 3, DL_INT = 0, DL_UINT = 1 };

/* The element stride that walks every element of t in order (row-major), or 0 when no
 * single stride does (a strided view of more than one dimension). */
static int64_t flat_stride(const DLTensorV0 *t) {
    if (t->ndim == 0 || !t->strides)
        return 1;
    if (t->ndim == 1)
        return t->strides[0];
    int64_t want = 1;
    for (int32_t i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->strides[i] != want)
            return 0;
        want *= t->shape[i];
    }
    return 1;
}

static long long read_int(const char *p, int code, int bits) {
    switch (bits) {
    case 8: return code == DL_INT ? (long long)*(const int8_t *)p : (long long)*(const uint8_t *)p;
    case 16: return code == DL_INT ? (long long)*(const int16_t *)p : (long long)*(const uint16_t *)p;
    case 32: return code == DL_INT ? (long long)*(const int32_t *)p : (long long)*(const uint32_t *)p;
    default: return (long long)*(const int64_t *)p; /* a uint64 above LLONG_MAX wraps, as numpy's astype does */
    }
}

/* dlpack_facts(capsule): (device_type, device_id, numel, dtype_code, dtype_bits, ptr, runs)
 * of the tensor a "dltensor" capsule holds. ptr is 0 for an empty tensor. runs are the
 * ((start, length), ...) of its values in row-major order, read in place, where they are
 * host memory (DLPack CPU or CUDA host) of an integer type and one stride walks them;
 * else None (a device tensor's values are never read, nor those of a non-empty tensor whose
 * data pointer is null). */
static PyObject *dlpack_facts(PyObject *Py_UNUSED(mod), PyObject *cap) {
    if (!PyCapsule_IsValid(cap, "dltensor")) {
        PyErr_Format(PyExc_TypeError, "dlpack_facts: an unconsumed \"dltensor\" capsule is needed, got %.100s",
                     Py_TYPE(cap)->tp_name);
        return NULL;
    }
    DLManagedTensorV0 *m = (DLManagedTensorV0 *)PyCapsule_GetPointer(cap, "dltensor");
    if (!m)
        return NULL;
    const DLTensorV0 *t = &m->dl_tensor;
    if (t->ndim < 0 || (t->ndim > 0 && !t->shape)) {
        PyErr_Format(PyExc_ValueError, "dlpack_facts: the capsule's tensor has ndim %d and %s shape", (int)t->ndim,
                     t->shape ? "a" : "no");
        return NULL;
    }
    long long numel = 1;
    for (int32_t i = 0; i < t->ndim; i++) {
        int64_t d = t->shape[i];
        if (d < 0 || (d && numel > LLONG_MAX / d)) {
            PyErr_Format(PyExc_ValueError, "dlpack_facts: dimension %d of the capsule's tensor is %lld", (int)i,
                         (long long)d);
            return NULL;
        }
        numel *= d;
    }
    unsigned long long ptr = numel ? (unsigned long long)(uintptr_t)t->data + t->byte_offset : 0;
    int code = t->dtype.code, bits = t->dtype.bits;
    int host = t->device.device_type == DL_CPU || t->device.device_type == DL_CUDA_HOST;
    int ints = (code == DL_INT || code == DL_UINT) && t->dtype.lanes == 1 &&
               (bits == 8 || bits == 16 || bits == 32 || bits == 64);
    int64_t stride = host && ints ? flat_stride(t) : 0;
    PyObject *runs;
    /* no memory behind a non-empty tensor (a wrapper subclass has no storage): nothing to read */
    if (!host || !ints || (numel > 1 && stride <= 0) || (numel && !t->data)) {
        runs = Py_NewRef(Py_None);
    } else {
        const char *base = (const char *)(uintptr_t)ptr;
        int64_t step = stride * (bits / 8);
        PyObject *out = PyList_New(0);
        long long start = 0, prev = 0, x;
        for (long long i = 0; out && i < numel; i++) {
            x = read_int(base + i * step, code, bits);
            if (i && follows(prev, x)) {
                prev = x;
                continue;
            }
            if (i && append_tuple(out, Py_BuildValue("(LL)", start, prev - start + 1)) < 0) {
                Py_CLEAR(out);
                break;
            }
            start = prev = x;
        }
        if (out && numel && append_tuple(out, Py_BuildValue("(LL)", start, prev - start + 1)) < 0)
            Py_CLEAR(out);
        runs = list_to_tuple(out);
        if (!runs)
            return NULL;
    }
    return Py_BuildValue("(iiLiiKN)", (int)t->device.device_type, (int)t->device.device_id, numel, code, bits, ptr,
                         runs);
}

/* pair_runs_of(host, device): ((host_start, device_start, length), ...) of pairs consecutive
 * on both sides; as zip(), the longer side's extra values are not read. */
static PyObject *pair_runs_of(PyObject *Py_UNUSED(mod), PyObject *args) {
    PyObject *ho, *dobj;
    if (!PyArg_ParseTuple(args, "OO:pair_runs_of", &ho, &dobj))
        return NULL;
    Values h, d;
    if (values_open(&h, ho, "pair_runs_of host") < 0)
        return NULL;
    if (values_open(&d, dobj, "pair_runs_of device") < 0) {
        values_close(&h);
        return NULL;
    }
    Py_ssize_t n = h.n < d.n ? h.n : d.n;
    PyObject *out = PyList_New(0);
    long long h0 = 0, d0 = 0, len = 0, hx, dx;
    for (Py_ssize_t i = 0; out && i < n; i++) {
        if (values_get(&h, i, &hx) < 0 || values_get(&d, i, &dx) < 0)
            goto fail;
        if (i && follows(h0 + (len - 1), hx) && follows(d0 + (len - 1), dx)) { /* the last values: no overflow */
            len++;
            continue;
        }
        if (i && append_tuple(out, Py_BuildValue("(LLL)", h0, d0, len)) < 0)
            goto fail;
        h0 = hx;
        d0 = dx;
        len = 1;
    }
    if (out && n && append_tuple(out, Py_BuildValue("(LLL)", h0, d0, len)) < 0)
        goto fail;
    values_close(&h);
    values_close(&d);
    return list_to_tuple(out);
fail:
    Py_XDECREF(out);
    values_close(&h);
    values_close(&d);
    return NULL;
}

/* side_runs(pair_runs, side): the ((start, length), ...) of one side (0 host, 1 device)
 * of pair_runs_of output, consecutive runs of that side joined. */
static PyObject *side_runs(PyObject *Py_UNUSED(mod), PyObject *args) {
    PyObject *pairs;
    int side;
    if (!PyArg_ParseTuple(args, "Oi:side_runs", &pairs, &side))
        return NULL;
    if (side != 0 && side != 1) {
        PyErr_Format(PyExc_ValueError, "side_runs: side must be 0 (host) or 1 (device), got %d", side);
        return NULL;
    }
    PyObject *seq = PySequence_Tuple(pairs);
    if (!seq)
        return NULL;
    PyObject *out = PyList_New(0);
    long long start = 0, end = 0;
    int have = 0;
    for (Py_ssize_t i = 0; out && i < PyTuple_GET_SIZE(seq); i++) {
        PyObject *run = PySequence_Tuple(PyTuple_GET_ITEM(seq, i));
        if (!run)
            goto fail;
        if (PyTuple_GET_SIZE(run) != 3) {
            PyErr_Format(PyExc_TypeError, "side_runs: a pair run is (host, device, length), got %R", run);
            Py_DECREF(run);
            goto fail;
        }
        long long s = PyLong_AsLongLong(PyTuple_GET_ITEM(run, side));
        long long n = s == -1 && PyErr_Occurred() ? 0 : PyLong_AsLongLong(PyTuple_GET_ITEM(run, 2));
        if (PyErr_Occurred()) {
            Py_DECREF(run);
            goto fail;
        }
        long long e;
        if (n <= 0 || __builtin_add_overflow(s, n, &e)) { /* a length pair_runs_of never gives */
            PyErr_Format(n <= 0 ? PyExc_ValueError : PyExc_OverflowError, "side_runs: pair run %zd %R has %s", i,
                         run, n <= 0 ? "a length <= 0" : "an end beyond 64 bits");
            Py_DECREF(run);
            goto fail;
        }
        Py_DECREF(run);
        if (have && s == end) {
            long long len;
            if (__builtin_add_overflow(end, n, &e) || __builtin_sub_overflow(e, start, &len)) {
                PyErr_Format(PyExc_OverflowError, "side_runs: joined run from %lld is longer than 64 bits", start);
                goto fail;
            }
            end = e;
            continue;
        }
        if (have && append_tuple(out, Py_BuildValue("(LL)", start, end - start)) < 0)
            goto fail;
        start = s;
        end = e;
        have = 1;
    }
    if (out && have && append_tuple(out, Py_BuildValue("(LL)", start, end - start)) < 0)
        goto fail;
    Py_DECREF(seq);
    return list_to_tuple(out);
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* ---------------------------------------------------------------- a submission's tensors
 *
 * use_refs and recorded are the SGLang adapter's description of one submission, run once
 * it returned, with torch function dispatch off (the caller's): the TensorRef of each
 * index tensor its copies received, and which of them its record_stream calls held. They
 * ran as about fifteen Python calls a submission; here they are two.
 *
 * use_refs(uses, cache, ref_type, names, slow) -> list
 *   uses      dict (pool, role) -> tensor, in the order the copies received them
 *   cache     dict (id(tensor), pool, role) -> TensorRef: read, and filled with what is made
 *   ref_type  the TensorRef class
 *   names     (dtype names: dict dtype -> str, device names: dict torch.device -> str,
 *              the torch.device class)
 *   slow      tensor_meta(tensor, pool, role) -> TensorRef, the pure description
 * A tensor is described here where it reports is_cuda with a device of the torch.device
 * class that names holds, or is_cpu, and its dtype is in names: the fields tensor_meta
 * would give. Any other tensor goes to slow. */
/* the names the adapter's steps read and write, interned once when the module loads */
static PyObject *s_is_cuda, *s_is_cpu, *s_device, *s_dtype, *s_numel, *s_data_ptr, *s_cpu, *s_ptr, *s_kwnames;
static PyObject *s_name, *s_host_indices, *s_device_indices, *s_host;
static PyObject *s_sub, *s_records, *s_append, *s_pool_transfers, *s_indices_from_pool, *s_copied;
static PyObject *s_known, *s_thread, *s_describe, *s_depth, *s_enter, *s_exit, *s_zero, *s_one;
static PyObject *s_int64, *s_int32, *s_value_kwnames, *s_dunder_dict, *s_pop;
static PyObject *s_refs, *s_merged_emitted, *s_take, *s_acks, *s_pools_at, *s_event_setup, *s_durable;
static PyObject *s_timing_enabled, *s_completed_kwnames;
static PyObject *s_id, *s_node_ids, *s_priority, *s_op, *s_queued_ops, *s_event_kwnames;
static PyObject *s_uses, *s_direction, *s_host_indices_on_cpu, *s_side_moves, *s_sampled, *s_moves,
    *s_write_back_jit, *s_add;

static int adapter_strings(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_is_cuda, "is_cuda"}, {&s_is_cpu, "is_cpu"}, {&s_device, "device"}, {&s_dtype, "dtype"},
        {&s_numel, "numel"}, {&s_data_ptr, "data_ptr"}, {&s_cpu, "cpu"}, {&s_ptr, "ptr"},
        {&s_name, "name"}, {&s_host_indices, "host_indices"}, {&s_device_indices, "device_indices"},
        {&s_host, "host"}, {&s_sub, "sub"}, {&s_records, "records"},
        {&s_append, "append"}, {&s_pool_transfers, "pool_transfers"}, {&s_indices_from_pool, "indices_from_pool"},
        {&s_copied, "copied"}, {&s_known, "known"}, {&s_thread, "thread"}, {&s_describe, "describe"},
        {&s_depth, "depth"}, {&s_enter, "__enter__"}, {&s_exit, "__exit__"}, {&s_int64, "int64"},
        {&s_int32, "int32"}, {&s_dunder_dict, "__dict__"}, {&s_pop, "pop"}, {&s_uses, "uses"},
        {&s_direction, "direction"}, {&s_host_indices_on_cpu, "host_indices_on_cpu"}, {&s_side_moves, "side_moves"},
        {&s_sampled, "sampled"}, {&s_moves, "moves"}, {&s_write_back_jit, "can_use_write_back_jit"}, {&s_add, "add"},
        {&s_id, "id"}, {&s_node_ids, "node_ids"}, {&s_priority, "priority"}, {&s_op, "op"}, {&s_queued_ops, "queued_ops"},
        {&s_refs, "refs"}, {&s_merged_emitted, "merged_emitted"}, {&s_take, "take"}, {&s_acks, "acks"},
        {&s_pools_at, "pools_at"}, {&s_event_setup, "event_setup"}, {&s_durable, "durable"},
        {&s_timing_enabled, "timing_enabled"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!(*names[i].slot = PyUnicode_InternFromString(names[i].text)))
            return -1;
    s_kwnames = Py_BuildValue("(ssssss)", "pool", "role", "device", "numel", "dtype", "ptr");
    s_value_kwnames = Py_BuildValue("(sssssss)", "pool", "role", "device", "numel", "dtype", "ptr", "indices");
    /* submission_event's fields, in its order */
    s_event_kwnames = Py_BuildValue("(sssssssssssssssssss)", "op", "direction", "stream", "io_backend", "layout",
                                    "tensors", "slots_by_pool", "bytes_by_pool", "producer_id", "device",
                                    "host_indices_on_cpu", "sidecar_pools", "queued", "node_ids", "moves", "records",
                                    "sampled", "pools", "audit_sample");
    s_completed_kwnames = Py_BuildValue("(sss)", "op", "direction", "duration_ns");
    s_zero = PyLong_FromLong(0);
    s_one = PyLong_FromLong(1);
    return s_kwnames && s_value_kwnames && s_event_kwnames && s_completed_kwnames && s_zero && s_one ? 0 : -1;
}

/* 0 where a function that takes n arguments got nargs of them; else -1 with a TypeError */
static int takes(const char *name, Py_ssize_t nargs, Py_ssize_t n) {
    if (nargs == n)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, n, nargs);
    return -1;
}

/* A borrowed bool attribute: 1, 0, or -1 with an error. */
static int attr_true(PyObject *t, PyObject *name) {
    PyObject *v = PyObject_GetAttr(t, name);
    if (!v)
        return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* The device name tensor_meta gives t, new reference; NULL with no error: ask slow. */
static PyObject *fast_device(PyObject *t, PyObject *cuda_names, PyObject *device_type) {
    int cuda = attr_true(t, s_is_cuda);
    if (cuda < 0)
        return NULL;
    if (cuda) {
        PyObject *dev = PyObject_GetAttr(t, s_device);
        if (!dev)
            return NULL;
        PyObject *name = NULL;
        if ((PyObject *)Py_TYPE(dev) == device_type) {
            name = PyDict_GetItemWithError(cuda_names, dev); /* borrowed */
            Py_XINCREF(name);
        }
        Py_DECREF(dev);
        return name; /* a miss goes to slow, which fills the names; an error is raised */
    }
    int cpu = attr_true(t, s_is_cpu);
    if (cpu <= 0)
        return NULL;
    Py_INCREF(s_cpu);
    return s_cpu;
}

/* tensor_meta(t, pool, role) where every field reads the fast way; NULL with no error
 * where one does not (the caller asks slow), NULL with an error on a failed read. */
static PyObject *fast_meta(PyObject *t, PyObject *pool, PyObject *role, PyObject *ref_type, PyObject *dtype_names,
                           PyObject *cuda_names, PyObject *device_type) {
    PyObject *numel = NULL, *dev = NULL, *dtype = NULL, *dname, *ptr = NULL, *ref = NULL;
    numel = PyObject_CallMethodNoArgs(t, s_numel);
    if (!numel)
        return NULL;
    dev = fast_device(t, cuda_names, device_type);
    if (!dev)
        goto done;
    dtype = PyObject_GetAttr(t, s_dtype);
    if (!dtype)
        goto done;
    dname = PyDict_GetItemWithError(dtype_names, dtype); /* borrowed: held from here on */
    if (!dname)
        goto done;
    Py_INCREF(dname);
    int nonzero = PyObject_IsTrue(numel);
    if (nonzero > 0)
        ptr = PyObject_CallMethodNoArgs(t, s_data_ptr);
    else if (nonzero == 0)
        ptr = PyLong_FromLong(0);
    if (!ptr) {
        Py_DECREF(dname);
        goto done;
    }
    PyObject *args[6] = {pool, role, dev, numel, dname, ptr};
    ref = PyObject_Vectorcall(ref_type, args, 0, s_kwnames);
    Py_DECREF(dname);
done:
    Py_XDECREF(numel);
    Py_XDECREF(dev);
    Py_XDECREF(dtype);
    Py_XDECREF(ptr);
    return ref;
}

static PyObject *use_refs(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("use_refs", nargs, 5) < 0)
        return NULL;
    PyObject *uses = args[0], *cache = args[1], *ref_type = args[2], *names = args[3], *slow = args[4];
    if (!PyDict_Check(uses) || !PyDict_Check(cache)) {
        PyErr_SetString(PyExc_TypeError, "use_refs(): uses and cache are dicts");
        return NULL;
    }
    if (!PyCallable_Check(ref_type) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "use_refs(): ref_type (the TensorRef class) and slow are callables");
        return NULL;
    }
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != 3 || !PyDict_Check(PyTuple_GET_ITEM(names, 0)) ||
        !PyDict_Check(PyTuple_GET_ITEM(names, 1))) {
        PyErr_SetString(PyExc_TypeError, "use_refs(): names is (dtype names dict, device names dict, device class)");
        return NULL;
    }
    PyObject *dtype_names = PyTuple_GET_ITEM(names, 0), *cuda_names = PyTuple_GET_ITEM(names, 1);
    PyObject *device_type = PyTuple_GET_ITEM(names, 2);
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    Py_ssize_t pos = 0, size = PyDict_GET_SIZE(uses);
    PyObject *key, *t;
    while (PyDict_Next(uses, &pos, &key, &t)) {
        if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 2) {
            PyErr_Format(PyExc_TypeError, "use_refs(): a key of uses is (pool, role), got %R", key);
            goto fail;
        }
        Py_INCREF(key); /* held while Python code runs (a tensor's properties, slow) */
        Py_INCREF(t);
        PyObject *pool = PyTuple_GET_ITEM(key, 0), *role = PyTuple_GET_ITEM(key, 1);
        PyObject *ck = Py_BuildValue("(NOO)", PyLong_FromVoidPtr(t), pool, role);
        PyObject *ref = ck ? PyDict_GetItemWithError(cache, ck) : NULL; /* borrowed */
        if (ref && ref != Py_None) {
            Py_INCREF(ref);
        } else if (ck && !PyErr_Occurred()) {
            ref = fast_meta(t, pool, role, ref_type, dtype_names, cuda_names, device_type);
            if (!ref && !PyErr_Occurred())
                ref = PyObject_CallFunctionObjArgs(slow, t, pool, role, NULL);
            if (ref && PyDict_SetItem(cache, ck, ref) < 0)
                Py_CLEAR(ref);
        } else {
            ref = NULL;
        }
        Py_XDECREF(ck);
        Py_DECREF(key);
        Py_DECREF(t);
        if (!ref)
            goto fail;
        int r = PyList_Append(out, ref);
        Py_DECREF(ref);
        if (r < 0)
            goto fail;
        if (PyDict_GET_SIZE(uses) != size) {
            PyErr_SetString(PyExc_RuntimeError, "dictionary changed size during iteration");
            goto fail;
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* meta_ref(t, pool, role, ref_type, names, slow) -> TensorRef
 *   One tensor's description as use_refs makes it, uncached: read the fast way where it
 *   can be (see fast_meta), else slow(t, pool, role). Run with torch function dispatch off.
 * device_of(t, names, slow) -> str
 *   One tensor's device name the fast way (see fast_device), else slow(t). */
static int names_ok(const char *fn, PyObject *names) {
    if (PyTuple_Check(names) && PyTuple_GET_SIZE(names) == 3 && PyDict_Check(PyTuple_GET_ITEM(names, 0)) &&
        PyDict_Check(PyTuple_GET_ITEM(names, 1)))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s(): names is (dtype names dict, device names dict, device class)", fn);
    return -1;
}

static PyObject *meta_ref(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("meta_ref", nargs, 6) < 0)
        return NULL;
    PyObject *t = args[0], *pool = args[1], *role = args[2], *ref_type = args[3], *names = args[4], *slow = args[5];
    if (names_ok("meta_ref", names) < 0)
        return NULL;
    if (!PyCallable_Check(ref_type) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "meta_ref(): ref_type (the TensorRef class) and slow are callables");
        return NULL;
    }
    PyObject *ref = fast_meta(t, pool, role, ref_type, PyTuple_GET_ITEM(names, 0), PyTuple_GET_ITEM(names, 1),
                              PyTuple_GET_ITEM(names, 2));
    if (ref || PyErr_Occurred())
        return ref;
    return PyObject_CallFunctionObjArgs(slow, t, pool, role, NULL);
}

static PyObject *device_of(PyObject *t, PyObject *cuda_names, PyObject *device_type, PyObject *slow);

static PyObject *device_name_of(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("device_of", nargs, 3) < 0)
        return NULL;
    PyObject *names = args[1], *slow = args[2];
    if (names_ok("device_of", names) < 0)
        return NULL;
    if (!PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "device_of(): slow is a callable");
        return NULL;
    }
    return device_of(args[0], PyTuple_GET_ITEM(names, 1), PyTuple_GET_ITEM(names, 2), slow);
}

/* value_ref(t, pool, role, dev, values, ref_type, names, to_dlpack, slow): t's TensorRef
 * with its values, as the SGLang adapter's tensor_ref makes it, for the common tensor: its
 * device named the fast way (dev None) or given, one DLPack export that torch makes (size,
 * address, an index dtype, and where values is true, the tensor is on "cpu" and not empty,
 * the runs of its values). Any other tensor is slow(t, pool, role, dev, values)'s. Run with
 * torch function dispatch off. */
static PyObject *value_ref(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("value_ref", nargs, 9) < 0)
        return NULL;
    PyObject *t = args[0], *pool = args[1], *role = args[2], *given = args[3], *values = args[4];
    PyObject *ref_type = args[5], *names = args[6], *to_dlpack = args[7], *slow = args[8];
    if (names_ok("value_ref", names) < 0)
        return NULL;
    PyObject *dev = NULL, *cap = NULL, *facts = NULL, *ref = NULL;
    if (given != Py_None)
        dev = Py_NewRef(given);
    else if (!(dev = fast_device(t, PyTuple_GET_ITEM(names, 1), PyTuple_GET_ITEM(names, 2))) && PyErr_Occurred())
        return NULL;
    if (!dev || to_dlpack == Py_None)
        goto slow_path;
    cap = PyObject_CallOneArg(to_dlpack, t);
    if (!cap) {
        if (PyErr_ExceptionMatches(PyExc_RuntimeError) || PyErr_ExceptionMatches(PyExc_TypeError) ||
            PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear(); /* torch cannot export it: the tensor's own methods answer */
            goto slow_path;
        }
        goto done;
    }
    if (!(facts = dlpack_facts(NULL, cap)))
        goto done;
    Py_CLEAR(cap); /* the export is freed here, as the pure path frees it */
    long code = PyLong_AsLong(PyTuple_GET_ITEM(facts, 3)), bits = PyLong_AsLong(PyTuple_GET_ITEM(facts, 4));
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(facts, 0));
    if (PyErr_Occurred())
        goto done;
    PyObject *dname = code == 0 && bits == 64 ? s_int64 : code == 0 && bits == 32 ? s_int32 : NULL;
    if (!dname)
        goto slow_path; /* not an index dtype: torch's own name */
    PyObject *numel = PyTuple_GET_ITEM(facts, 2), *runs = Py_None;
    int want = PyObject_IsTrue(values);
    if (want < 0)
        goto done;
    if (want && PyUnicode_Check(dev) && PyUnicode_CompareWithASCIIString(dev, "cpu") == 0) {
        int nonzero = PyObject_IsTrue(numel);
        if (nonzero < 0)
            goto done;
        if (nonzero) {
            runs = PyTuple_GET_ITEM(facts, 6);
            if (runs == Py_None && (kind == 1 || kind == 3))
                goto slow_path; /* host values one stride does not walk: read through numpy */
        }
    }
    if (runs != Py_None) {
        int any = PyObject_IsTrue(runs);
        if (any < 0)
            goto done;
        if (!any)
            runs = Py_None; /* an empty tensor's () is no values */
    }
    PyObject *fields[7] = {pool, role, dev, numel, dname, PyTuple_GET_ITEM(facts, 5), runs};
    ref = PyObject_Vectorcall(ref_type, fields, 0, s_value_kwnames);
    goto done;
slow_path:
    ref = PyObject_Vectorcall(slow, (PyObject *[]){t, pool, role, given, values}, 5, NULL);
done:
    Py_XDECREF(dev);
    Py_XDECREF(cap);
    Py_XDECREF(facts);
    return ref;
}

/* recorded(tensors, refs, records, stream, stream_name, stream_names) -> list
 *   tensors       the submission's used tensors, in order (its uses' values)
 *   refs          their TensorRefs, in the same order
 *   records       [(tensor, stream), ...], the record_stream calls made, in order
 *   stream        the submission's stream, named stream_name
 *   stream_names  dict id(stream) -> name; a stream not in it is "stream@<id in hex>"
 * Each record on a used tensor is (its place in tensors, the stream's name); a record on
 * another tensor object with the same memory (data_ptr, or 0 when empty, and numel) as
 * used ones counts for them; a record on other memory for none. A tensor several places
 * hold is recorded for each. */
/* "stream@<id in hex>", as the adapter names a stream it does not know */
static PyObject *unnamed_stream(PyObject *stream) {
    char buf[40];
    PyOS_snprintf(buf, sizeof buf, "stream@%llx", (unsigned long long)(uintptr_t)stream);
    return PyUnicode_FromString(buf);
}

static void free_facts(Py_ssize_t *order, PyObject **facts, Py_ssize_t n) {
    if (facts)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(facts[i]);
    PyMem_Free(facts);
    PyMem_Free(order);
}

static PyObject *recorded(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("recorded", nargs, 6) < 0)
        return NULL;
    PyObject *tensors = args[0], *refs = args[1], *records = args[2], *stream = args[3], *stream_name = args[4];
    PyObject *stream_names = args[5];
    if (!PyList_Check(tensors) || !PyList_Check(refs) || !PyList_Check(records) || !PyDict_Check(stream_names)) {
        PyErr_SetString(PyExc_TypeError, "recorded(): tensors, refs and records are lists, stream_names a dict");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    if (PyList_GET_SIZE(refs) != n) {
        PyErr_Format(PyExc_ValueError, "recorded(): %zd tensors and %zd refs", n, PyList_GET_SIZE(refs));
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    /* the order a record on other memory lists its hits in: the used tensors' distinct
     * objects in the order first seen, each with all its places */
    Py_ssize_t *order = NULL;
    PyObject **facts = NULL; /* (ptr, numel) of each ref, read once a record needs them */
    PyObject *held = NULL; /* the record being matched, held while Python code runs */
    for (Py_ssize_t r = 0; r < PyList_GET_SIZE(records); r++) {
        PyObject *rec = PyList_GET_ITEM(records, r);
        held = rec;
        Py_INCREF(held);
        if (!PyTuple_Check(rec) || PyTuple_GET_SIZE(rec) != 2) {
            PyErr_Format(PyExc_TypeError, "recorded(): a record is (tensor, stream), got %R", rec);
            goto fail;
        }
        PyObject *tensor = PyTuple_GET_ITEM(rec, 0), *rec_stream = PyTuple_GET_ITEM(rec, 1);
        Py_ssize_t first = -1;
        for (Py_ssize_t i = 0; i < n; i++)
            if (PyList_GET_ITEM(tensors, i) == tensor) {
                first = i;
                break;
            }
        PyObject *key = NULL; /* (data_ptr or 0, numel) of the record's tensor */
        if (first < 0) { /* the same memory seen through another tensor object */
            if (!order) {
                order = PyMem_Malloc(sizeof(Py_ssize_t) * (n ? n : 1));
                facts = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
                if (!order || !facts) {
                    PyErr_NoMemory();
                    goto fail;
                }
                Py_ssize_t k = 0;
                for (Py_ssize_t i = 0; i < n; i++) {
                    PyObject *ti = PyList_GET_ITEM(tensors, i);
                    int seen = 0;
                    for (Py_ssize_t j = 0; j < i; j++)
                        if (PyList_GET_ITEM(tensors, j) == ti) {
                            seen = 1;
                            break;
                        }
                    if (seen)
                        continue;
                    for (Py_ssize_t j = i; j < n; j++)
                        if (PyList_GET_ITEM(tensors, j) == ti)
                            order[k++] = j;
                }
                for (Py_ssize_t i = 0; i < n; i++) {
                    PyObject *ref = PyList_GET_ITEM(refs, i);
                    PyObject *p = PyObject_GetAttr(ref, s_ptr);
                    PyObject *m = p ? PyObject_GetAttr(ref, s_numel) : NULL;
                    facts[i] = m ? PyTuple_Pack(2, p, m) : NULL;
                    Py_XDECREF(p);
                    Py_XDECREF(m);
                    if (!facts[i])
                        goto fail;
                }
            }
            PyObject *m = PyObject_CallMethodNoArgs(tensor, s_numel);
            if (!m)
                goto fail;
            int nonzero = PyObject_IsTrue(m);
            PyObject *p = nonzero > 0 ? PyObject_CallMethodNoArgs(tensor, s_data_ptr) : nonzero == 0 ? PyLong_FromLong(0) : NULL;
            key = p ? PyTuple_Pack(2, p, m) : NULL;
            Py_XDECREF(p);
            Py_DECREF(m);
            if (!key)
                goto fail;
        }
        PyObject *name = NULL;
        for (Py_ssize_t k = 0; k < n; k++) {
            Py_ssize_t i;
            if (first >= 0) {
                i = k;
                if (PyList_GET_ITEM(tensors, i) != tensor)
                    continue;
            } else {
                i = order[k];
                int eq = PyObject_RichCompareBool(facts[i], key, Py_EQ);
                if (eq < 0) {
                    Py_XDECREF(name);
                    Py_DECREF(key);
                    goto fail;
                }
                if (!eq)
                    continue;
            }
            if (!name) {
                if (rec_stream == stream) {
                    name = stream_name;
                    Py_INCREF(name);
                } else {
                    PyObject *id = PyLong_FromVoidPtr(rec_stream);
                    if (!id) {
                        Py_XDECREF(key);
                        goto fail;
                    }
                    name = PyDict_GetItemWithError(stream_names, id);
                    Py_DECREF(id);
                    int named = 0;
                    if (name) { /* its name, unless empty (the adapter's `or`) */
                        Py_INCREF(name);
                        named = PyObject_IsTrue(name);
                        if (named <= 0)
                            Py_CLEAR(name);
                    }
                    if (named < 0 || (!name && PyErr_Occurred()) || (!name && !(name = unnamed_stream(rec_stream)))) {
                        Py_XDECREF(key);
                        goto fail;
                    }
                }
            }
            PyObject *hit = Py_BuildValue("(nO)", i, name);
            if (!hit || PyList_Append(out, hit) < 0) {
                Py_XDECREF(hit);
                Py_DECREF(name);
                Py_XDECREF(key);
                goto fail;
            }
            Py_DECREF(hit);
        }
        Py_XDECREF(name);
        Py_XDECREF(key);
        Py_CLEAR(held);
    }
    free_facts(order, facts, n);
    return out;
fail:
    Py_XDECREF(held);
    free_facts(order, facts, n);
    Py_DECREF(out);
    return NULL;
}

/* ---------------------------------------------------------------- an op's index tensors
 *
 * op_tensors(host, device, transfers, anchor, tensor_type, pool_names, pool_name) -> dict
 *   The index tensors of an op: {(anchor, "host"): host, (anchor, "device"): device} and,
 *   for each of transfers (or none where it is falsy), {(pool, "host"): its host_indices,
 *   (pool, "device"): its device_indices}, each only where it is a tensor_type. A transfer's
 *   pool is its name's text: pool_names[id(name)] = (name, text) where that entry holds this
 *   name object, else pool_name(name).
 *
 * device_changes(before, after, names, slow) -> list
 *   [((pool, role), was, now, new tensor), ...]: the tensors of before (op_tensors of an op
 *   before a move) that after (after it) holds as another object on another device, in
 *   before's order. Device names as device_name gives them (names as for use_refs; any
 *   other tensor is slow(tensor)'s). Run with torch function dispatch off. */
/* out[(pool, role)] = t where t is a tensor_type; 0, or -1 with an error */
static int put_tensor(PyObject *out, PyObject *pool, PyObject *role, PyObject *t, PyObject *tensor_type) {
    int is = PyObject_IsInstance(t, tensor_type);
    if (is <= 0)
        return is;
    PyObject *key = PyTuple_Pack(2, pool, role);
    if (!key)
        return -1;
    int r = PyDict_SetItem(out, key, t);
    Py_DECREF(key);
    return r;
}

/* The text of a transfer's pool (t.name): pool_names[id(name)] = (name, text) where that
 * entry holds this name object, else pool_name(name); new reference, or NULL with an error. */
static PyObject *transfer_pool(PyObject *t, PyObject *pool_names, PyObject *pool_name) {
    PyObject *name = PyObject_GetAttr(t, s_name), *pool = NULL;
    if (!name)
        return NULL;
    PyObject *id = PyLong_FromVoidPtr(name);
    PyObject *hit = id ? PyDict_GetItemWithError(pool_names, id) : NULL; /* borrowed */
    Py_XDECREF(id);
    if (hit && PyTuple_CheckExact(hit) && PyTuple_GET_SIZE(hit) == 2 && PyTuple_GET_ITEM(hit, 0) == name) {
        pool = PyTuple_GET_ITEM(hit, 1);
        Py_INCREF(pool);
    } else if (!PyErr_Occurred()) {
        pool = PyObject_CallOneArg(pool_name, name);
    }
    Py_DECREF(name);
    return pool;
}

/* getattr(obj, name, None), new reference: NULL only with an error other than AttributeError */
static PyObject *attr_or_none(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return v;
    PyErr_Clear();
    Py_RETURN_NONE;
}

/* int(t.numel()), new reference */
static PyObject *numel_of(PyObject *t) {
    PyObject *n = PyObject_CallMethodNoArgs(t, s_numel);
    if (!n || PyLong_CheckExact(n))
        return n;
    PyObject *i = PyNumber_Long(n);
    Py_DECREF(n);
    return i;
}

static PyObject *op_tensors(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("op_tensors", nargs, 7) < 0)
        return NULL;
    PyObject *host = args[0], *device = args[1], *transfers = args[2], *anchor = args[3], *tensor_type = args[4];
    PyObject *pool_names = args[5], *pool_name = args[6];
    if (!PyDict_Check(pool_names)) {
        PyErr_SetString(PyExc_TypeError, "op_tensors(): pool_names is a dict");
        return NULL;
    }
    /* every transfer's (pool, host, device) is read before any is put, as a list of them */
    PyObject *rows = PyList_New(0), *out = NULL;
    if (!rows)
        return NULL;
    int some = PyObject_IsTrue(transfers);
    if (some < 0)
        goto done;
    if (some) {
        PyObject *it = PyObject_GetIter(transfers), *t;
        if (!it)
            goto done;
        while ((t = PyIter_Next(it))) {
            PyObject *pool = transfer_pool(t, pool_names, pool_name), *row = NULL;
            if (pool) {
                PyObject *h = PyObject_GetAttr(t, s_host_indices);
                PyObject *d = h ? PyObject_GetAttr(t, s_device_indices) : NULL;
                if (d)
                    row = PyTuple_Pack(3, pool, h, d);
                Py_XDECREF(h);
                Py_XDECREF(d);
                Py_DECREF(pool);
            }
            Py_DECREF(t);
            if (!row || PyList_Append(rows, row) < 0) {
                Py_XDECREF(row);
                Py_DECREF(it);
                goto done;
            }
            Py_DECREF(row);
        }
        Py_DECREF(it);
        if (PyErr_Occurred())
            goto done;
    }
    out = PyDict_New();
    if (!out || put_tensor(out, anchor, s_host, host, tensor_type) < 0 ||
        put_tensor(out, anchor, s_device, device, tensor_type) < 0)
        goto fail;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rows); i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        PyObject *pool = PyTuple_GET_ITEM(row, 0);
        if (put_tensor(out, pool, s_host, PyTuple_GET_ITEM(row, 1), tensor_type) < 0 ||
            put_tensor(out, pool, s_device, PyTuple_GET_ITEM(row, 2), tensor_type) < 0)
            goto fail;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_DECREF(rows);
    return out;
}

/* slots_by_pool(op, anchor, pool_names, pool_name) -> ((pool, slots), ...)
 *   The slots an op moves per pool: the anchor's (its host indices' numel), then, in the
 *   order of op.pool_transfers, each transfer's pool (named as op_tensors names it) with
 *   the numel of its host indices, else of its device indices, else 0, a pool's transfers
 *   summed; a transfer whose indices come from another pool (indices_from_pool) is not
 *   counted. Run with torch function dispatch off. */
static PyObject *slots_by_pool(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("slots_by_pool", nargs, 4) < 0)
        return NULL;
    PyObject *op = args[0], *anchor = args[1], *pool_names = args[2], *pool_name = args[3];
    if (!PyDict_Check(pool_names)) {
        PyErr_SetString(PyExc_TypeError, "slots_by_pool(): pool_names is a dict");
        return NULL;
    }
    PyObject *slots = PyDict_New(), *out = NULL, *transfers = NULL, *it = NULL, *t = NULL;
    if (!slots)
        return NULL;
    PyObject *host = PyObject_GetAttr(op, s_host_indices);
    PyObject *n = host ? numel_of(host) : NULL;
    Py_XDECREF(host);
    int r = n ? PyDict_SetItem(slots, anchor, n) : -1;
    Py_XDECREF(n);
    if (r < 0)
        goto done;
    transfers = attr_or_none(op, s_pool_transfers);
    if (!transfers)
        goto done;
    int some = PyObject_IsTrue(transfers);
    if (some < 0)
        goto done;
    if (some) {
        if (!(it = PyObject_GetIter(transfers)))
            goto done;
        while ((t = PyIter_Next(it))) {
            PyObject *from = attr_or_none(t, s_indices_from_pool);
            if (!from)
                goto done;
            int shared = from != Py_None;
            Py_DECREF(from);
            if (shared) {
                Py_CLEAR(t);
                continue;
            }
            PyObject *idx = PyObject_GetAttr(t, s_host_indices);
            if (idx == Py_None) {
                Py_DECREF(idx);
                idx = PyObject_GetAttr(t, s_device_indices);
            }
            if (!idx)
                goto done;
            PyObject *pool = transfer_pool(t, pool_names, pool_name), *count = NULL;
            PyObject *add = !pool ? NULL : idx == Py_None ? PyLong_FromLong(0) : numel_of(idx);
            if (add) {
                PyObject *had = PyDict_GetItemWithError(slots, pool); /* borrowed */
                if (had)
                    count = PyNumber_Add(had, add);
                else if (!PyErr_Occurred())
                    count = (Py_INCREF(add), add);
                Py_DECREF(add);
            }
            Py_DECREF(idx);
            r = count ? PyDict_SetItem(slots, pool, count) : -1;
            Py_XDECREF(count);
            Py_XDECREF(pool);
            Py_CLEAR(t);
            if (r < 0)
                goto done;
        }
        if (PyErr_Occurred())
            goto done;
    }
    out = PyTuple_New(PyDict_GET_SIZE(slots));
    if (out) {
        Py_ssize_t pos = 0, i = 0;
        PyObject *k, *v;
        while (PyDict_Next(slots, &pos, &k, &v)) {
            PyObject *pair = PyTuple_Pack(2, k, v);
            if (!pair) {
                Py_CLEAR(out);
                break;
            }
            PyTuple_SET_ITEM(out, i++, pair);
        }
    }
done:
    Py_XDECREF(t);
    Py_XDECREF(it);
    Py_XDECREF(transfers);
    Py_DECREF(slots);
    return out;
}

/* device_name(t) where it reads the fast way (see fast_device), else slow(t); new reference */
static PyObject *device_of(PyObject *t, PyObject *cuda_names, PyObject *device_type, PyObject *slow) {
    PyObject *name = fast_device(t, cuda_names, device_type);
    if (name || PyErr_Occurred())
        return name;
    return PyObject_CallOneArg(slow, t);
}

static PyObject *device_changes(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("device_changes", nargs, 4) < 0)
        return NULL;
    PyObject *before = args[0], *after = args[1], *names = args[2], *slow = args[3];
    if (!PyDict_Check(before) || !PyDict_Check(after)) {
        PyErr_SetString(PyExc_TypeError, "device_changes(): before and after are dicts");
        return NULL;
    }
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != 3 || !PyDict_Check(PyTuple_GET_ITEM(names, 1))) {
        PyErr_SetString(PyExc_TypeError, "device_changes(): names is (dtype names dict, device names dict, device class)");
        return NULL;
    }
    PyObject *cuda_names = PyTuple_GET_ITEM(names, 1), *device_type = PyTuple_GET_ITEM(names, 2);
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    Py_ssize_t pos = 0, size = PyDict_GET_SIZE(before);
    PyObject *key, *src;
    while (PyDict_Next(before, &pos, &key, &src)) {
        if (PyDict_GET_SIZE(before) != size) {
            PyErr_SetString(PyExc_RuntimeError, "dictionary changed size during iteration");
            goto fail;
        }
        PyObject *dst = PyDict_GetItemWithError(after, key); /* borrowed */
        if (!dst) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        if (dst == src || dst == Py_None)
            continue;
        Py_INCREF(key);
        Py_INCREF(src);
        Py_INCREF(dst);
        PyObject *was = device_of(src, cuda_names, device_type, slow);
        PyObject *now = was ? device_of(dst, cuda_names, device_type, slow) : NULL;
        int differ = now ? PyObject_RichCompareBool(now, was, Py_NE) : -1;
        PyObject *row = differ > 0 ? PyTuple_Pack(4, key, was, now, dst) : NULL;
        int r = differ > 0 ? (row ? PyList_Append(out, row) : -1) : differ;
        Py_XDECREF(row);
        Py_XDECREF(was);
        Py_XDECREF(now);
        Py_DECREF(key);
        Py_DECREF(src);
        Py_DECREF(dst);
        if (r < 0)
            goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* received(uses, pool, host, device, tensor_type) -> dict
 *   A copy's index tensors, now uses of its op: uses[(pool, "host")] and
 *   uses[(pool, "device")] where not there yet, for each that is a tensor_type; returns
 *   {id(tensor): (role, tensor)} of those that do not report is_cuda (an index tensor off
 *   the device, which the copy could move to it itself). Run with torch function dispatch
 *   off. */
static PyObject *received(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("received", nargs, 5) < 0)
        return NULL;
    PyObject *uses = args[0], *pool = args[1], *tensor_type = args[4];
    if (!PyDict_Check(uses)) {
        PyErr_SetString(PyExc_TypeError, "received(): uses is a dict");
        return NULL;
    }
    PyObject *watched = PyDict_New();
    if (!watched)
        return NULL;
    PyObject *roles[2] = {s_host, s_device};
    for (int i = 0; i < 2; i++) {
        PyObject *t = args[2 + i];
        int is = PyObject_IsInstance(t, tensor_type);
        if (is < 0)
            goto fail;
        if (!is)
            continue;
        PyObject *key = PyTuple_Pack(2, pool, roles[i]);
        PyObject *had = key ? PyDict_SetDefault(uses, key, t) : NULL; /* borrowed */
        Py_XDECREF(key);
        if (!had)
            goto fail;
        int cuda = attr_true(t, s_is_cuda);
        if (cuda < 0)
            goto fail;
        if (cuda)
            continue;
        PyObject *id = PyLong_FromVoidPtr(t);
        PyObject *entry = id ? PyTuple_Pack(2, roles[i], t) : NULL;
        int r = entry ? PyDict_SetItem(watched, id, entry) : -1;
        Py_XDECREF(id);
        Py_XDECREF(entry);
        if (r < 0)
            goto fail;
    }
    return watched;
fail:
    Py_DECREF(watched);
    return NULL;
}

/* submission_event(emit, cls, sub, op_id, refs, result, now, pools, setup) -> the event
 *   A submission's one event (the SGLang adapter's metrics and sampling profiles), as
 *   emit(cls, **fields) makes it, from what its hooks noted on sub:
 *   setup  (streams, stream_names, io_backend, layout, device, sidecar_pools, audit_sample,
 *          slot_bytes, queued_at, anchor, pool_names, pool_name, moved_type, h2d):
 *          streams maps sub.direction to (owner, attribute) of its stream; queued_at maps
 *          id(op) to when it was queued (each queued op's entry taken, now where none);
 *          the rest as slots_by_pool, recorded and the event's fields take them.
 *   refs   the TensorRefs of sub.uses's tensors, in order (a list).
 * Fields: op, direction, stream (its name), io_backend, layout, tensors, slots_by_pool and
 * bytes_by_pool of sub.op (none without one), producer_id (result where a load's is an int,
 * else -1), device, host_indices_on_cpu, sidecar_pools, queued ((op, node, priority, when)
 * of each of sub.queued_ops), node_ids (of sub.op), moves (sub.moves, then each of
 * sub.side_moves as moved_type(pool, role, src, dst, ref, stream)), records, sampled, pools,
 * audit_sample. Run with torch function dispatch off. */
enum { EV_STREAMS, EV_STREAM_NAMES, EV_IO_BACKEND, EV_LAYOUT, EV_DEVICE, EV_SIDECARS, EV_AUDIT_SAMPLE,
       EV_SLOT_BYTES, EV_QUEUED_AT, EV_ANCHOR, EV_POOL_NAMES, EV_POOL_NAME, EV_MOVED, EV_H2D, EV_N };

static PyObject *slots_by_pool(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs);

/* int(obj), new reference */
static PyObject *as_int(PyObject *obj) { return PyNumber_Long(obj); }

/* (op, node, priority, when) of one queued op: node_ids[0] (or -1 where it has none),
 * priority (or its id where None); when: queued_at.pop(id(op), now). */
static PyObject *queued_row(PyObject *q, PyObject *queued_at, PyObject *now) {
    PyObject *id = NULL, *node = NULL, *priority = NULL, *when = NULL, *row = NULL;
    PyObject *raw = PyObject_GetAttr(q, s_id);
    if (!raw || !(id = as_int(raw)))
        goto done;
    PyObject *nodes = attr_or_none(q, s_node_ids);
    if (!nodes)
        goto done;
    int some = PyObject_IsTrue(nodes);
    if (some > 0) {
        PyObject *first = PySequence_GetItem(nodes, 0);
        node = first ? as_int(first) : NULL;
        Py_XDECREF(first);
    } else if (some == 0) {
        node = PyLong_FromLong(-1);
    }
    Py_DECREF(nodes);
    if (!node)
        goto done;
    PyObject *prio = PyObject_GetAttr(q, s_priority);
    if (!prio)
        goto done;
    if (prio == Py_None) {
        Py_DECREF(prio);
        priority = Py_NewRef(id);
    } else {
        priority = as_int(prio);
        Py_DECREF(prio);
        if (!priority)
            goto done;
    }
    PyObject *key = PyLong_FromVoidPtr(q);
    if (!key)
        goto done;
    PyObject *pargs[3] = {queued_at, key, now};
    when = PyObject_VectorcallMethod(s_pop, pargs, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(key);
    if (when)
        row = PyTuple_Pack(4, id, node, priority, when);
done:
    Py_XDECREF(raw);
    Py_XDECREF(id);
    Py_XDECREF(node);
    Py_XDECREF(priority);
    Py_XDECREF(when);
    return row;
}

/* tuple(f(item) for item in iterable), new reference */
static PyObject *tuple_of(PyObject *iterable, PyObject *(*f)(PyObject *, void *), void *ctx) {
    PyObject *out = PyList_New(0), *it = out ? PyObject_GetIter(iterable) : NULL, *item;
    if (!it) {
        Py_XDECREF(out);
        return NULL;
    }
    while ((item = PyIter_Next(it))) {
        PyObject *v = f(item, ctx);
        Py_DECREF(item);
        int r = v ? PyList_Append(out, v) : -1;
        Py_XDECREF(v);
        if (r < 0)
            break;
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) {
        Py_DECREF(out);
        return NULL;
    }
    PyObject *t = PyList_AsTuple(out);
    Py_DECREF(out);
    return t;
}

static PyObject *int_of(PyObject *item, void *ctx) { return as_int(item); }

typedef struct {
    PyObject *queued_at, *now;
} QueuedCtx;

static PyObject *queued_of(PyObject *item, void *ctx) {
    QueuedCtx *c = ctx;
    return queued_row(item, c->queued_at, c->now);
}

typedef struct {
    PyObject *moved_type, *stream_name;
} MovedCtx;

/* moved_type(pool, role, src, dst, ref, stream) of one side move (pool, role, src, dst, ref) */
static PyObject *moved_of(PyObject *item, void *ctx) {
    MovedCtx *c = ctx;
    PyObject *t = PySequence_Tuple(item);
    if (!t)
        return NULL;
    if (PyTuple_GET_SIZE(t) != 5) {
        PyErr_Format(PyExc_ValueError, "a side move is (pool, role, src, dst, ref), got %R", t);
        Py_DECREF(t);
        return NULL;
    }
    PyObject *args[6];
    for (int i = 0; i < 5; i++)
        args[i] = PyTuple_GET_ITEM(t, i);
    args[5] = c->stream_name;
    PyObject *m = PyObject_Vectorcall(c->moved_type, args, 6, NULL);
    Py_DECREF(t);
    return m;
}

typedef struct {
    PyObject *slot_bytes;
} BytesCtx;

/* (pool, slots * slot_bytes.get(pool, 0)) of one (pool, slots) */
static PyObject *bytes_of(PyObject *item, void *ctx) {
    BytesCtx *c = ctx;
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
        PyErr_Format(PyExc_TypeError, "slots_by_pool gave %R, not (pool, slots)", item);
        return NULL;
    }
    PyObject *pool = PyTuple_GET_ITEM(item, 0);
    PyObject *size = PyDict_GetItemWithError(c->slot_bytes, pool); /* borrowed */
    if (!size && PyErr_Occurred())
        return NULL;
    PyObject *n = PyNumber_Multiply(PyTuple_GET_ITEM(item, 1), size ? size : s_zero);
    PyObject *out = n ? PyTuple_Pack(2, pool, n) : NULL;
    Py_XDECREF(n);
    return out;
}

static PyObject *submission_event(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("submission_event", nargs, 9) < 0)
        return NULL;
    PyObject *emit = args[0], *cls = args[1], *sub = args[2], *op_id = args[3], *refs = args[4], *result = args[5];
    PyObject *now = args[6], *pools = args[7], *setup_t = args[8];
    if (!PyTuple_CheckExact(setup_t) || PyTuple_GET_SIZE(setup_t) != EV_N) {
        PyErr_Format(PyExc_TypeError, "submission_event(): setup is a tuple of %d, got %R", EV_N, setup_t);
        return NULL;
    }
    PyObject *const *setup = &PyTuple_GET_ITEM(setup_t, 0);
    if (!PyDict_Check(setup[EV_STREAMS]) || !PyDict_Check(setup[EV_STREAM_NAMES]) ||
        !PyDict_Check(setup[EV_SLOT_BYTES]) || !PyDict_Check(setup[EV_QUEUED_AT]) || !PyList_Check(refs)) {
        PyErr_SetString(PyExc_TypeError, "submission_event(): setup's streams, stream_names, slot_bytes and "
                                         "queued_at are dicts, refs a list");
        return NULL;
    }
    enum { F_OP, F_DIRECTION, F_STREAM, F_IO, F_LAYOUT, F_TENSORS, F_SLOTS, F_BYTES, F_PRODUCER, F_DEVICE, F_ON_CPU,
           F_SIDECARS, F_QUEUED, F_NODES, F_MOVES, F_RECORDS, F_SAMPLED, F_POOLS, F_AUDIT, F_N };
    PyObject *v[1 + F_N] = {NULL}; /* v[0]: cls; the fields from v[1] */
    PyObject **f = v + 1;
    PyObject *op = NULL, *stream = NULL, *event = NULL, *uses = NULL, *tensors = NULL, *records = NULL;
    PyObject *side = NULL, *moves = NULL, *on_cpu = NULL, *queued_ops = NULL, *record_list = NULL;
    v[0] = Py_NewRef(cls);
    f[F_OP] = Py_NewRef(op_id);
    if (!(f[F_DIRECTION] = PyObject_GetAttr(sub, s_direction)))
        goto done;
    PyObject *where = PyDict_GetItemWithError(setup[EV_STREAMS], f[F_DIRECTION]); /* borrowed */
    if (!where) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_KeyError, "submission_event(): no stream for direction %R", f[F_DIRECTION]);
        goto done;
    }
    if (!PyTuple_Check(where) || PyTuple_GET_SIZE(where) != 2) {
        PyErr_Format(PyExc_TypeError, "submission_event(): streams maps to (owner, attribute), got %R", where);
        goto done;
    }
    if (!(stream = PyObject_GetAttr(PyTuple_GET_ITEM(where, 0), PyTuple_GET_ITEM(where, 1))))
        goto done;
    PyObject *key = PyLong_FromVoidPtr(stream);
    PyObject *name = key ? PyDict_GetItemWithError(setup[EV_STREAM_NAMES], key) : NULL; /* borrowed */
    Py_XDECREF(key);
    if (!name && PyErr_Occurred())
        goto done;
    int named = name ? PyObject_IsTrue(name) : 0;
    if (named < 0)
        goto done;
    if (!(f[F_STREAM] = named ? Py_NewRef(name) : unnamed_stream(stream)))
        goto done;
    f[F_IO] = Py_NewRef(setup[EV_IO_BACKEND]);
    f[F_LAYOUT] = Py_NewRef(setup[EV_LAYOUT]);
    if (!(f[F_TENSORS] = PyList_AsTuple(refs)) || !(op = PyObject_GetAttr(sub, s_op)))
        goto done;
    if (op == Py_None) {
        f[F_SLOTS] = PyTuple_New(0);
        f[F_BYTES] = PyTuple_New(0);
        f[F_NODES] = PyTuple_New(0);
        if (!f[F_SLOTS] || !f[F_BYTES] || !f[F_NODES])
            goto done;
    } else {
        PyObject *sargs[4] = {op, setup[EV_ANCHOR], setup[EV_POOL_NAMES], setup[EV_POOL_NAME]};
        if (!(f[F_SLOTS] = slots_by_pool(NULL, sargs, 4)))
            goto done;
        BytesCtx bc = {setup[EV_SLOT_BYTES]};
        if (!(f[F_BYTES] = tuple_of(f[F_SLOTS], bytes_of, &bc)))
            goto done;
        PyObject *nodes = attr_or_none(op, s_node_ids);
        int some = nodes ? PyObject_IsTrue(nodes) : -1;
        f[F_NODES] = some > 0 ? tuple_of(nodes, int_of, NULL) : some == 0 ? PyTuple_New(0) : NULL;
        Py_XDECREF(nodes);
        if (!f[F_NODES])
            goto done;
    }
    int load = PyObject_RichCompareBool(f[F_DIRECTION], setup[EV_H2D], Py_EQ);
    if (load < 0)
        goto done;
    if (!(f[F_PRODUCER] = load && PyLong_Check(result) ? as_int(result) : PyLong_FromLong(-1)))
        goto done;
    f[F_DEVICE] = Py_NewRef(setup[EV_DEVICE]);
    if (!(on_cpu = PyObject_GetAttr(sub, s_host_indices_on_cpu)) || !(f[F_ON_CPU] = PySequence_Tuple(on_cpu)))
        goto done;
    f[F_SIDECARS] = Py_NewRef(setup[EV_SIDECARS]);
    QueuedCtx qc = {setup[EV_QUEUED_AT], now};
    if (!(queued_ops = PyObject_GetAttr(sub, s_queued_ops)) || !(f[F_QUEUED] = tuple_of(queued_ops, queued_of, &qc)))
        goto done;
    if (!(moves = PyObject_GetAttr(sub, s_moves)) || !(side = PyObject_GetAttr(sub, s_side_moves)))
        goto done;
    MovedCtx mc = {setup[EV_MOVED], f[F_STREAM]};
    PyObject *ours = PySequence_Tuple(moves), *theirs = ours ? tuple_of(side, moved_of, &mc) : NULL;
    f[F_MOVES] = theirs ? PySequence_Concat(ours, theirs) : NULL;
    Py_XDECREF(ours);
    Py_XDECREF(theirs);
    if (!f[F_MOVES])
        goto done;
    if (!(uses = PyObject_GetAttr(sub, s_uses)) || !(records = PyObject_GetAttr(sub, s_records)))
        goto done;
    if (!PyDict_Check(uses)) {
        PyErr_SetString(PyExc_TypeError, "submission_event(): the submission's uses is a dict");
        goto done;
    }
    if (!(tensors = PyDict_Values(uses)))
        goto done;
    PyObject *rargs[6] = {tensors, refs, records, stream, f[F_STREAM], setup[EV_STREAM_NAMES]};
    if (!(record_list = recorded(NULL, rargs, 6)) || !(f[F_RECORDS] = PyList_AsTuple(record_list)))
        goto done;
    if (!(f[F_SAMPLED] = PyObject_GetAttr(sub, s_sampled)))
        goto done;
    f[F_POOLS] = Py_NewRef(pools);
    f[F_AUDIT] = Py_NewRef(setup[EV_AUDIT_SAMPLE]);
    event = PyObject_Vectorcall(emit, v, 1, s_event_kwnames);
done:
    for (int i = 0; i < 1 + F_N; i++)
        Py_XDECREF(v[i]);
    Py_XDECREF(op);
    Py_XDECREF(stream);
    Py_XDECREF(uses);
    Py_XDECREF(tensors);
    Py_XDECREF(records);
    Py_XDECREF(record_list);
    Py_XDECREF(side);
    Py_XDECREF(moves);
    Py_XDECREF(on_cpu);
    Py_XDECREF(queued_ops);
    return event;
}

/* read_free_lists(obj, head, rest, tensor_type): one read of an allocator's free lists, as the
 * SGLang adapter's _FreeList keeps them: (the first list, the others, how many pages or slots
 * they hold). The first list (attribute head) stays a tensor_type, or becomes a tuple of its
 * values (a list of ints changes in place). Each (name, counter) of rest: a list is kept as
 * (list, its length) and counts obj.<counter> where that is an int, else the numel() of its
 * parts; a missing or None attribute is None; anything else is kept and counts its numel(). */
static PyObject *read_free_lists(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("read_free_lists", nargs, 4) < 0)
        return NULL;
    PyObject *obj = args[0], *rest = args[2], *tensor_type = args[3];
    if (!PyTuple_Check(rest)) {
        PyErr_SetString(PyExc_TypeError, "read_free_lists(): rest is a tuple of (name, counter)");
        return NULL;
    }
    Py_ssize_t k = PyTuple_GET_SIZE(rest);
    PyObject *head = NULL, *n = NULL, *parts = NULL, *v = NULL, *add = NULL;
    head = PyObject_GetAttr(obj, args[1]);
    if (!head)
        return NULL;
    int is = PyObject_IsInstance(head, tensor_type);
    if (is < 0)
        goto fail;
    if (is) {
        n = PyObject_CallMethodNoArgs(head, s_numel);
    } else {
        int truth = PyObject_IsTrue(head);
        if (truth < 0)
            goto fail;
        PyObject *values = truth ? PySequence_Tuple(head) : PyTuple_New(0);
        if (!values)
            goto fail;
        Py_SETREF(head, values);
        n = PyLong_FromSsize_t(PyTuple_GET_SIZE(head));
    }
    if (!n || !(parts = PyTuple_New(k)))
        goto fail;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *pair = PyTuple_GET_ITEM(rest, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "read_free_lists(): rest is a tuple of (name, counter)");
            goto fail;
        }
        PyObject *name = PyTuple_GET_ITEM(pair, 0), *counter = PyTuple_GET_ITEM(pair, 1);
        if (!(v = attr_or_none(obj, name)))
            goto fail;
        PyObject *part;
        if (PyList_Check(v)) {
            PyObject *held = NULL;
            int named = PyObject_IsTrue(counter);
            if (named < 0 || (named && !(held = attr_or_none(obj, counter))))
                goto fail;
            if (held && PyLong_Check(held)) {
                add = held;
            } else {
                Py_XDECREF(held);
                if (!(add = PyLong_FromLong(0)))
                    goto fail;
                for (Py_ssize_t j = 0; j < PyList_GET_SIZE(v); j++) { /* as sum() iterates it */
                    PyObject *x = Py_NewRef(PyList_GET_ITEM(v, j));
                    PyObject *m = PyObject_CallMethodNoArgs(x, s_numel);
                    Py_DECREF(x);
                    PyObject *sum = m ? PyNumber_Add(add, m) : NULL;
                    Py_XDECREF(m);
                    Py_SETREF(add, sum);
                    if (!add)
                        goto fail;
                }
            }
            Py_ssize_t len = PyObject_Length(v);
            part = len < 0 ? NULL : Py_BuildValue("(On)", v, len);
        } else {
            if (v != Py_None && !(add = PyObject_CallMethodNoArgs(v, s_numel)))
                goto fail;
            part = Py_NewRef(v);
        }
        if (!part)
            goto fail;
        PyTuple_SET_ITEM(parts, i, part);
        Py_CLEAR(v);
        if (add) {
            PyObject *sum = PyNumber_Add(n, add);
            Py_CLEAR(add);
            if (!sum)
                goto fail;
            Py_SETREF(n, sum);
        }
    }
    PyObject *out = PyTuple_Pack(3, head, parts, n);
    Py_DECREF(head);
    Py_DECREF(parts);
    Py_DECREF(n);
    return out;
fail:
    Py_XDECREF(head);
    Py_XDECREF(n);
    Py_XDECREF(parts);
    Py_XDECREF(v);
    Py_XDECREF(add);
    return NULL;
}

/* ---------------------------------------------------------------- the record observer
 *
 * RecordObserver(original, current): what the SGLang adapter puts as
 * torch.Tensor.record_stream while a controller is instrumented (a descriptor: it binds
 * to the tensor as a method does). A call record_stream(tensor, stream) with current.sub
 * set, on a thread not already inside a record (recording_here: torch-function dispatch
 * calls the observer again), makes the record (original(tensor, stream)) with
 * recording_here set, then appends (tensor, stream) to current.sub.records; any other
 * call, or one of another shape, is original's as it came (record_stream(tensor,
 * stream=s) is the same call). A record that raised was not made: it is not appended. */
static _Thread_local int recording_here;

typedef struct {
    PyObject_HEAD
    PyObject *original, *current;
    vectorcallfunc vectorcall;
} RecordObserver;

static int observer_cleared(RecordObserver *self) {
    if (self->original && self->current)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "RecordObserver: cleared by the garbage collector");
    return -1;
}

static PyObject *observer_call(RecordObserver *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (observer_cleared(self) < 0)
        return NULL;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs == 1 && kwnames && PyTuple_GET_SIZE(kwnames) == 1 &&
        PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "stream") == 0) {
        kwnames = NULL; /* record_stream(tensor, stream=s): the same call */
        nargs = 2;
        nargsf = 2;
    }
    if (nargs != 2 || kwnames)
        return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    PyObject *sub = PyObject_GetAttr(self->current, s_sub);
    if (!sub)
        return NULL;
    if (sub == Py_None) {
        Py_DECREF(sub);
        return PyObject_Vectorcall(self->original, args, nargsf, NULL);
    }
    if (recording_here) {
        Py_DECREF(sub);
        return PyObject_Vectorcall(self->original, args, nargsf, NULL);
    }
    recording_here = 1;
    PyObject *made = PyObject_Vectorcall(self->original, args, nargsf, NULL);
    recording_here = 0; /* whatever the record did */
    if (!made) {
        Py_DECREF(sub);
        return NULL;
    }
    Py_DECREF(made);
    PyObject *records = PyObject_GetAttr(sub, s_records);
    Py_DECREF(sub);
    if (!records)
        return NULL;
    PyObject *pair = PyTuple_Pack(2, args[0], args[1]);
    int r = -1;
    if (pair && PyList_CheckExact(records)) {
        r = PyList_Append(records, pair);
    } else if (pair) {
        PyObject *ret = PyObject_CallMethodOneArg(records, s_append, pair);
        r = ret ? 0 : -1;
        Py_XDECREF(ret);
    }
    Py_XDECREF(pair);
    Py_DECREF(records);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *observer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *original, *current;
    static char *kw[] = {"original", "current", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:RecordObserver", kw, &original, &current))
        return NULL;
    if (!PyCallable_Check(original)) {
        PyErr_Format(PyExc_TypeError, "RecordObserver(): original is torch's record_stream, got %R", original);
        return NULL;
    }
    RecordObserver *self = (RecordObserver *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    Py_INCREF(original);
    Py_INCREF(current);
    self->original = original;
    self->current = current;
    self->vectorcall = (vectorcallfunc)observer_call;
    return (PyObject *)self;
}

static int observer_traverse(RecordObserver *self, visitproc visit, void *arg) {
    Py_VISIT(self->original);
    Py_VISIT(self->current);
    return 0;
}

static int observer_clear(RecordObserver *self) {
    Py_CLEAR(self->original);
    Py_CLEAR(self->current);
    return 0;
}

static void observer_dealloc(RecordObserver *self) {
    PyObject_GC_UnTrack(self);
    observer_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *observer_get(PyObject *self, PyObject *obj, PyObject *Py_UNUSED(type)) {
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

static PyObject *observer_wrapped(RecordObserver *self, void *Py_UNUSED(c)) {
    if (observer_cleared(self) < 0)
        return NULL;
    Py_INCREF(self->original);
    return self->original;
}

static PyObject *observer_doc(RecordObserver *self, void *Py_UNUSED(c)) {
    if (observer_cleared(self) < 0)
        return NULL;
    return PyObject_GetAttrString(self->original, "__doc__");
}

static PyGetSetDef observer_getset[] = {
    {"__wrapped__", (getter)observer_wrapped, NULL, "torch's record_stream, which makes the record", NULL},
    {"__doc__", (getter)observer_doc, NULL, "torch's record_stream's", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RecordObserverType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hicache_obs._slots.RecordObserver",
    .tp_basicsize = sizeof(RecordObserver),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(RecordObserver, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = observer_new,
    .tp_dealloc = (destructor)observer_dealloc,
    .tp_traverse = (traverseproc)observer_traverse,
    .tp_clear = (inquiry)observer_clear,
    .tp_descr_get = observer_get,
    .tp_getset = observer_getset,
};

/* ---------------------------------------------------------------- hooks
 *
 * CopyHook and ConversionObserver share one layout: a vectorcall and the objects it holds,
 * refs[0] the callable it stands in for (its __wrapped__). Neither binds: each is put as an
 * instance attribute. */
#define HOOK_REFS 5

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Py_ssize_t n; /* refs in use */
    PyObject *refs[HOOK_REFS];
} Hook;

/* 0 where every ref is held; -1 with an error where the garbage collector cleared them */
static int hook_alive(Hook *self) {
    for (Py_ssize_t i = 0; i < self->n; i++)
        if (!self->refs[i]) {
            PyErr_Format(PyExc_RuntimeError, "%s: cleared by the garbage collector", Py_TYPE(self)->tp_name);
            return -1;
        }
    return 0;
}

static PyObject *hook_new(PyTypeObject *type, vectorcallfunc call, Py_ssize_t n, PyObject *const *refs) {
    Hook *self = (Hook *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->n = n;
    for (Py_ssize_t i = 0; i < n; i++)
        self->refs[i] = Py_NewRef(refs[i]);
    self->vectorcall = call;
    return (PyObject *)self;
}

static int hook_traverse(Hook *self, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < self->n; i++)
        Py_VISIT(self->refs[i]);
    return 0;
}

static int hook_clear(Hook *self) {
    for (Py_ssize_t i = 0; i < self->n; i++)
        Py_CLEAR(self->refs[i]);
    return 0;
}

static void hook_dealloc(Hook *self) {
    PyObject_GC_UnTrack(self);
    hook_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *hook_wrapped(Hook *self, void *Py_UNUSED(c)) {
    if (hook_alive(self) < 0)
        return NULL;
    return Py_NewRef(self->refs[0]);
}

static PyGetSetDef hook_getset[] = {
    {"__wrapped__", (getter)hook_wrapped, NULL, "the callable the hook stands in for", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* A type whose objects are Hooks (their n refs traversed, cleared and freed alike), called
 * by vectorcall: the hooks (with __wrapped__) and the callbacks the adapter gives the queues
 * and the start hook (without). */
#define VECTORCALL_TYPE(c_name, py_name, new_fn, doc, getset)                                                   \
    static PyTypeObject c_name = {                                                                               \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hicache_obs._slots." py_name,                                  \
        .tp_doc = doc,                                                                                           \
        .tp_basicsize = sizeof(Hook),                                                                            \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,                        \
        .tp_vectorcall_offset = offsetof(Hook, vectorcall),                                                      \
        .tp_call = PyVectorcall_Call,                                                                            \
        .tp_new = new_fn,                                                                                        \
        .tp_dealloc = (destructor)hook_dealloc,                                                                  \
        .tp_traverse = (traverseproc)hook_traverse,                                                              \
        .tp_clear = (inquiry)hook_clear,                                                                         \
        .tp_getset = getset,                                                                                     \
    }
#define HOOK_TYPE(c_name, py_name, new_fn) VECTORCALL_TYPE(c_name, py_name, new_fn, NULL, hook_getset)
#define CALLBACK_TYPE(c_name, py_name, new_fn, doc) VECTORCALL_TYPE(c_name, py_name, new_fn, doc, NULL)

/* CopyHook(original, current, pool, first, setup): what the SGLang adapter puts as a host
 * pool's copy method. A call (device_pool, host_indices, device_indices, ...) outside a
 * submission (current.sub None), or one whose (pool, id(host_indices), id(device_indices))
 * is in current.sub.copied already (a load copies layer by layer with the same index
 * tensors), is original's as it came. A call of another shape is first's (which binds its
 * arguments by name and calls the hook again). Any other call, the first of these tensors
 * in the submission, notes its key in copied; with setup None it is then first's, else the
 * hook describes the copy itself (copy_first). */
enum { SETUP_WATCH, SETUP_FAILED, SETUP_TENSOR, SETUP_NTF, SETUP_METHODS, SETUP_RECEIVED, SETUP_KERNEL,
       SETUP_STAGED, SETUP_FULL, SETUP_D2H, SETUP_N };

static PyObject *place_observers(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs);
static PyObject *remove_observers(PyObject *Py_UNUSED(mod), PyObject *placed);
static PyObject *lock_exit(PyObject *lock, PyObject *out);
static PyObject *take_error(void);
static void raise_again(PyObject *v);
static void in_context_of(PyObject *context);

/* `except Exception: failed(what)` after a step that raised: 0 where the error was an
 * Exception and failed took it, -1 with an error (another BaseException, or failed's own). */
static int count_failure(PyObject *failed, const char *what) {
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return -1;
    PyErr_Clear();
    PyObject *text = PyUnicode_FromString(what);
    PyObject *r = text ? PyObject_CallOneArg(failed, text) : NULL;
    Py_XDECREF(text);
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* received(uses, pool, host, device, tensor_type) through setup's received, inside
 * `with no_torch_function():`; new reference, NULL with an error. */
static PyObject *received_quietly(PyObject *const *setup, PyObject *sub, PyObject *pool, PyObject *host,
                                  PyObject *device) {
    PyObject *uses = PyObject_GetAttr(sub, s_uses);
    if (!uses)
        return NULL;
    PyObject *ctx = PyObject_CallNoArgs(setup[SETUP_NTF]);
    PyObject *entered = ctx ? PyObject_VectorcallMethod(s_enter, &ctx, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL) : NULL;
    PyObject *watched = NULL;
    if (entered) {
        Py_DECREF(entered);
        PyObject *args[5] = {uses, pool, host, device, setup[SETUP_TENSOR]};
        watched = PyObject_Vectorcall(setup[SETUP_RECEIVED], args, 5, NULL);
        watched = lock_exit(ctx, watched); /* the context manager's exit, as `with` makes it */
    }
    Py_XDECREF(ctx);
    Py_DECREF(uses);
    if (watched && !PyDict_Check(watched)) {
        PyErr_Format(PyExc_TypeError, "received() gave %.100s, not a dict", Py_TYPE(watched)->tp_name);
        Py_CLEAR(watched);
    }
    return watched;
}

/* A staged write-back's pool noted in sub.host_indices_on_cpu (once): setup's staged host
 * pool set (an io backend `kernel`, a layout `page_first`), a write (sub.direction d2h)
 * and the pool's can_use_write_back_jit, read now, True. 0, or -1 with an error. */
static int note_staged(PyObject *const *setup, PyObject *sub, PyObject *pool) {
    PyObject *host_pool = setup[SETUP_STAGED];
    if (host_pool == Py_None)
        return 0;
    PyObject *direction = PyObject_GetAttr(sub, s_direction);
    int write = direction ? PyObject_RichCompareBool(direction, setup[SETUP_D2H], Py_EQ) : -1;
    Py_XDECREF(direction);
    if (write <= 0)
        return write;
    PyObject *jit = attr_or_none(host_pool, s_write_back_jit);
    if (!jit)
        return -1;
    int staged = jit == Py_True;
    Py_DECREF(jit);
    if (!staged)
        return 0;
    PyObject *on_cpu = PyObject_GetAttr(sub, s_host_indices_on_cpu);
    int there = on_cpu ? PySequence_Contains(on_cpu, pool) : -1;
    PyObject *r = there == 0 ? PyObject_CallMethodOneArg(on_cpu, s_append, pool) : NULL;
    Py_XDECREF(on_cpu);
    if (there != 0)
        return there < 0 ? -1 : 0;
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* The roles of pool's moves in sub.side_moves ((pool, role, src, dst, ref), ...), as a new
 * set; NULL with an error. */
static PyObject *known_roles(PyObject *side_moves, PyObject *pool) {
    PyObject *known = PySet_New(NULL), *it = known ? PyObject_GetIter(side_moves) : NULL, *m;
    if (!it) {
        Py_XDECREF(known);
        return NULL;
    }
    while ((m = PyIter_Next(it))) {
        PyObject *p = PySequence_GetItem(m, 0);
        int mine = p ? PyObject_RichCompareBool(p, pool, Py_EQ) : -1;
        Py_XDECREF(p);
        PyObject *role = mine > 0 ? PySequence_GetItem(m, 1) : NULL;
        int r = mine > 0 ? (role ? PySet_Add(known, role) : -1) : mine;
        Py_XDECREF(role);
        Py_DECREF(m);
        if (r < 0)
            break;
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) {
        Py_DECREF(known);
        return NULL;
    }
    return known;
}

/* The moves the watch saw, of roles not known yet, appended to side_moves as (pool, role,
 * src, dst, ref); their roles added to known. 0, or -1 with an error. */
static int keep_moves(PyObject *watch, PyObject *pool, PyObject *known, PyObject *side_moves) {
    if (!PyList_Check(side_moves)) {
        PyErr_SetString(PyExc_TypeError, "the submission's side_moves is a list");
        return -1;
    }
    PyObject *moves = PyObject_GetAttr(watch, s_moves);
    PyObject *it = moves ? PyObject_GetIter(moves) : NULL, *m;
    Py_XDECREF(moves);
    if (!it)
        return -1;
    while ((m = PyIter_Next(it))) {
        PyObject *t = PySequence_Tuple(m);
        Py_DECREF(m);
        if (!t)
            break;
        int r = -1;
        if (PyTuple_GET_SIZE(t) != 4) {
            PyErr_Format(PyExc_ValueError, "the conversion watch's moves are (role, src, dst, ref), got %R", t);
        } else {
            PyObject *role = PyTuple_GET_ITEM(t, 0);
            r = PySet_Contains(known, role);
            if (r == 0) {
                PyObject *entry = PyTuple_Pack(5, pool, role, PyTuple_GET_ITEM(t, 1), PyTuple_GET_ITEM(t, 2),
                                               PyTuple_GET_ITEM(t, 3));
                r = entry ? PyList_Append(side_moves, entry) : -1;
                Py_XDECREF(entry);
                if (r == 0)
                    r = PySet_Add(known, role);
            }
        }
        Py_DECREF(t);
        if (r < 0)
            break;
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

/* The conversion watch of one copy: made (setup's watch class, called (pool, watched, failed,
 * known, values)) and its observers placed; NULL with an error, and what was placed taken off
 * again. *known and *side_moves: new references the caller releases. */
static PyObject *watch_copy(PyObject *const *setup, PyObject *sub, PyObject *pool, PyObject *watched,
                            PyObject *placed, PyObject **known, PyObject **side_moves) {
    if (note_staged(setup, sub, pool) < 0)
        return NULL;
    *side_moves = PyObject_GetAttr(sub, s_side_moves);
    *known = *side_moves ? known_roles(*side_moves, pool) : NULL;
    if (!*known)
        return NULL;
    int values = PyObject_IsTrue(setup[SETUP_FULL]);
    if (values == 0) {
        PyObject *sampled = PyObject_GetAttr(sub, s_sampled);
        values = sampled ? PyObject_IsTrue(sampled) : -1;
        Py_XDECREF(sampled);
    }
    if (values < 0)
        return NULL;
    PyObject *frozen = PyFrozenSet_New(*known);
    PyObject *args[5] = {pool, watched, setup[SETUP_FAILED], frozen, values ? Py_True : Py_False};
    PyObject *watch = frozen ? PyObject_Vectorcall(setup[SETUP_WATCH], args, 5, NULL) : NULL;
    Py_XDECREF(frozen);
    if (!watch)
        return NULL;
    PyObject *pargs[5] = {watched, setup[SETUP_METHODS], setup[SETUP_TENSOR], watch, placed};
    PyObject *r = place_observers(NULL, pargs, 5);
    if (!r) {
        PyObject *raised = take_error();
        PyObject *gone = remove_observers(NULL, placed);
        Py_XDECREF(gone);
        PyErr_Clear();
        raise_again(raised);
        Py_DECREF(watch);
        return NULL;
    }
    Py_DECREF(r);
    return watch;
}

/* The first call of a submission's copy with these index tensors (key noted in copied):
 * `received` notes them as the op's uses; where one is off the device and the io backend is
 * `kernel`, the copy runs under a conversion watch (see the adapter's _ConversionWatch), and
 * the moves it saw of roles this pool's copies had not moved yet join sub.side_moves. A step
 * of this bookkeeping that raises is counted (setup's failed) and the copy runs as it came;
 * an error of the copy itself is raised as it came, after the watch is off. */
static PyObject *copy_first(Hook *self, PyObject *sub, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *original = self->refs[0], *pool = self->refs[2];
    PyObject *const *setup = &PyTuple_GET_ITEM(self->refs[4], 0);
    PyObject *watched = received_quietly(setup, sub, pool, args[1], args[2]);
    if (!watched) {
        if (count_failure(setup[SETUP_FAILED], "describe the index tensors a copy received") < 0)
            return NULL;
        return PyObject_Vectorcall(original, args, nargsf, kwnames);
    }
    if (PyDict_GET_SIZE(watched) == 0 || setup[SETUP_KERNEL] != Py_True) { /* nothing to watch */
        Py_DECREF(watched);
        return PyObject_Vectorcall(original, args, nargsf, kwnames);
    }
    PyObject *known = NULL, *side_moves = NULL, *placed = PyList_New(0), *out = NULL;
    PyObject *watch = placed ? watch_copy(setup, sub, pool, watched, placed, &known, &side_moves) : NULL;
    Py_DECREF(watched);
    if (!watch) {
        if (count_failure(setup[SETUP_FAILED], "watch the index tensors of a copy") == 0)
            out = PyObject_Vectorcall(original, args, nargsf, kwnames);
        goto done;
    }
    out = PyObject_Vectorcall(original, args, nargsf, kwnames);
    PyObject *raised = out ? NULL : take_error();
    PyObject *gone = remove_observers(NULL, placed);
    if (gone)
        Py_DECREF(gone);
    else if (count_failure(setup[SETUP_FAILED], "take the conversion watch off a copy's index tensors") < 0) {
        Py_XDECREF(raised);
        Py_CLEAR(out);
        goto done;
    }
    if (raised) {
        raise_again(raised);
        goto done;
    }
    if (keep_moves(watch, pool, known, side_moves) < 0 &&
        count_failure(setup[SETUP_FAILED], "record the index tensors a copy moved") < 0)
        Py_CLEAR(out);
done:
    Py_XDECREF(watch);
    Py_XDECREF(known);
    Py_XDECREF(side_moves);
    Py_XDECREF(placed);
    return out;
}

static PyObject *copy_hook_call(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (hook_alive(self) < 0)
        return NULL;
    PyObject *original = self->refs[0], *current = self->refs[1], *pool = self->refs[2], *first = self->refs[3];
    if (PyVectorcall_NARGS(nargsf) < 3)
        return PyObject_Vectorcall(first, args, nargsf, kwnames);
    PyObject *sub = PyObject_GetAttr(current, s_sub);
    if (!sub)
        return NULL;
    if (sub == Py_None) {
        Py_DECREF(sub);
        return PyObject_Vectorcall(original, args, nargsf, kwnames);
    }
    PyObject *copied = PyObject_GetAttr(sub, s_copied);
    if (!copied) {
        Py_DECREF(sub);
        return NULL;
    }
    PyObject *h = PyLong_FromVoidPtr(args[1]), *d = PyLong_FromVoidPtr(args[2]);
    PyObject *key = h && d ? PyTuple_Pack(3, pool, h, d) : NULL;
    Py_XDECREF(h);
    Py_XDECREF(d);
    int seen = key ? PySequence_Contains(copied, key) : -1;
    PyObject *out = NULL;
    if (seen > 0) {
        out = PyObject_Vectorcall(original, args, nargsf, kwnames);
    } else if (seen == 0 && self->refs[4] == Py_None) {
        out = PyObject_Vectorcall(first, args, nargsf, kwnames);
    } else if (seen == 0) {
        int added = PyAnySet_Check(copied) ? PySet_Add(copied, key) : -1;
        if (added < 0 && !PyErr_Occurred()) { /* another container: its own add */
            PyObject *r = PyObject_CallMethodOneArg(copied, s_add, key);
            added = r ? 0 : -1;
            Py_XDECREF(r);
        }
        if (added == 0)
            out = copy_first(self, sub, args, nargsf, kwnames);
    }
    Py_XDECREF(key);
    Py_DECREF(copied);
    Py_DECREF(sub);
    return out;
}

static PyObject *copy_hook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *refs[5] = {NULL, NULL, NULL, NULL, Py_None};
    static char *kw[] = {"original", "current", "pool", "first", "setup", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|O:CopyHook", kw, &refs[0], &refs[1], &refs[2], &refs[3],
                                     &refs[4]))
        return NULL;
    if (!PyCallable_Check(refs[0]) || !PyCallable_Check(refs[3])) {
        PyErr_Format(PyExc_TypeError, "CopyHook(): original (the pool's copy) and first are callables, got %R and %R",
                     refs[0], refs[3]);
        return NULL;
    }
    PyObject *setup = refs[4];
    if (setup != Py_None) {
        if (!PyTuple_CheckExact(setup) || PyTuple_GET_SIZE(setup) != SETUP_N) {
            PyErr_Format(PyExc_TypeError,
                         "CopyHook(): setup is None or a tuple of %d (watch, failed, tensor_type, no_torch_function, "
                         "methods, received, kernel, staged, full, d2h), got %R",
                         SETUP_N, setup);
            return NULL;
        }
        int callables[] = {SETUP_WATCH, SETUP_FAILED, SETUP_NTF, SETUP_RECEIVED};
        for (size_t i = 0; i < sizeof callables / sizeof callables[0]; i++)
            if (!PyCallable_Check(PyTuple_GET_ITEM(setup, callables[i]))) {
                PyErr_Format(PyExc_TypeError, "CopyHook(): setup's watch, failed, no_torch_function and received are "
                                              "callables, got %R",
                             PyTuple_GET_ITEM(setup, callables[i]));
                return NULL;
            }
        if (!PyTuple_Check(PyTuple_GET_ITEM(setup, SETUP_METHODS))) {
            PyErr_Format(PyExc_TypeError, "CopyHook(): setup's methods is a tuple of names, got %R",
                         PyTuple_GET_ITEM(setup, SETUP_METHODS));
            return NULL;
        }
    }
    return hook_new(type, (vectorcallfunc)copy_hook_call, 5, refs);
}

HOOK_TYPE(CopyHookType, "CopyHook", copy_hook_new);

static PyObject *copy_hook(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 && nargs != 5) {
        PyErr_Format(PyExc_TypeError, "copy_hook() takes 4 or 5 arguments (%zd given)", nargs);
        return NULL;
    }
    return PyObject_Vectorcall((PyObject *)&CopyHookType, args, nargs, NULL);
}

/* MoveHook(original, current, fallback, setup): what the SGLang adapter puts as the
 * controller's op-level move of a merged op's indices (move(op, ...) -> (host, device[,
 * transfers])). A call outside a submission (current.sub None) or inside one whose op is
 * set (an inner move) is original's as it came; a call without op by position is
 * fallback's. Else sub.op is op, the op is noted as merged, and the tensors of op before
 * the call and of its result after it are compared (op_tensors, device_changes): each that
 * moved to another device is sub.moves's Moved(pool, role, was, now, ref), ref made once
 * per submission (sub.refs; with its values where sub.sampled), or with setup's full set,
 * report(sub, before, after). A step of this that raises is counted (failed) and the move
 * runs as it came (or its result is returned as it came).
 * setup: (full, merged, report, failed, no_torch_function, anchor, tensor_type, pool_names,
 *         pool_name, names, device_name, moved_type, ref_type, tensor_meta, tensor_ref) */
enum { MV_FULL, MV_MERGED, MV_REPORT, MV_FAILED, MV_NTF, MV_ANCHOR, MV_TENSOR, MV_POOL_NAMES, MV_POOL_NAME,
       MV_NAMES, MV_DEVICE_NAME, MV_MOVED, MV_REF_TYPE, MV_TENSOR_META, MV_TENSOR_REF, MV_N };

static PyObject *op_tensors(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs);
static PyObject *device_changes(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs);
static PyObject *meta_ref(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs);

/* op_tensors(host, device, transfers, ...) with setup's constants; new reference */
static PyObject *move_tensors(PyObject *const *setup, PyObject *host, PyObject *device, PyObject *transfers) {
    PyObject *args[7] = {host,          device, transfers, setup[MV_ANCHOR], setup[MV_TENSOR], setup[MV_POOL_NAMES],
                         setup[MV_POOL_NAME]};
    return op_tensors(NULL, args, 7);
}

/* op.host_indices, op.device_indices, getattr(op, "pool_transfers", None): op's tensors */
static PyObject *tensors_of_op(PyObject *const *setup, PyObject *op) {
    PyObject *host = PyObject_GetAttr(op, s_host_indices);
    PyObject *device = host ? PyObject_GetAttr(op, s_device_indices) : NULL;
    PyObject *transfers = device ? attr_or_none(op, s_pool_transfers) : NULL;
    PyObject *out = transfers ? move_tensors(setup, host, device, transfers) : NULL;
    Py_XDECREF(host);
    Py_XDECREF(device);
    Py_XDECREF(transfers);
    return out;
}

/* The tensors of a move's result: result[0], result[1], and result[2] where it has a third,
 * else getattr(op, "pool_transfers", None). */
static PyObject *tensors_of_result(PyObject *const *setup, PyObject *op, PyObject *result) {
    Py_ssize_t n = PyObject_Length(result);
    if (n < 0)
        return NULL;
    PyObject *host = PySequence_GetItem(result, 0);
    PyObject *device = host ? PySequence_GetItem(result, 1) : NULL;
    PyObject *transfers = !device ? NULL : n > 2 ? PySequence_GetItem(result, 2) : attr_or_none(op, s_pool_transfers);
    PyObject *out = transfers ? move_tensors(setup, host, device, transfers) : NULL;
    Py_XDECREF(host);
    Py_XDECREF(device);
    Py_XDECREF(transfers);
    return out;
}

/* sub.ref(t, pool, role): t's TensorRef in this submission, made once (sub.refs, keyed
 * (id(t), pool, role)): tensor_ref(t, pool, role) where sub.sampled, else meta_ref's. */
static PyObject *submission_ref(PyObject *const *setup, PyObject *sub, PyObject *t, PyObject *pool, PyObject *role) {
    PyObject *refs = PyObject_GetAttr(sub, s_refs);
    if (!refs)
        return NULL;
    PyObject *id = PyLong_FromVoidPtr(t), *key = id ? PyTuple_Pack(3, id, pool, role) : NULL, *got = NULL;
    Py_XDECREF(id);
    if (!key)
        goto done;
    if (PyDict_Check(refs)) {
        got = PyDict_GetItemWithError(refs, key);
        Py_XINCREF(got);
    } else {
        got = PyObject_GetItem(refs, key);
        if (!got && PyErr_ExceptionMatches(PyExc_KeyError))
            PyErr_Clear();
    }
    if (got || PyErr_Occurred())
        goto done;
    PyObject *sampled = PyObject_GetAttr(sub, s_sampled);
    int values = sampled ? PyObject_IsTrue(sampled) : -1;
    Py_XDECREF(sampled);
    if (values > 0) {
        got = PyObject_CallFunctionObjArgs(setup[MV_TENSOR_REF], t, pool, role, NULL);
    } else if (values == 0) {
        PyObject *args[6] = {t, pool, role, setup[MV_REF_TYPE], setup[MV_NAMES], setup[MV_TENSOR_META]};
        got = meta_ref(NULL, args, 6);
    }
    if (got && PyObject_SetItem(refs, key, got) < 0)
        Py_CLEAR(got);
done:
    Py_XDECREF(key);
    Py_DECREF(refs);
    return got;
}

/* Each tensor of before that after holds as another object on another device: a Moved on
 * sub.moves (under no_torch_function). 0, or -1 with an error. */
static int note_moves(PyObject *const *setup, PyObject *sub, PyObject *before, PyObject *after) {
    PyObject *ctx = PyObject_CallNoArgs(setup[MV_NTF]);
    PyObject *entered = ctx ? PyObject_VectorcallMethod(s_enter, &ctx, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL) : NULL;
    if (!entered) {
        Py_XDECREF(ctx);
        return -1;
    }
    Py_DECREF(entered);
    PyObject *moves = PyObject_GetAttr(sub, s_moves), *out = NULL;
    PyObject *args[4] = {before, after, setup[MV_NAMES], setup[MV_DEVICE_NAME]};
    PyObject *changes = moves ? device_changes(NULL, args, 4) : NULL;
    for (Py_ssize_t i = 0; changes && i < PyList_GET_SIZE(changes); i++) {
        PyObject *row = PyList_GET_ITEM(changes, i); /* ((pool, role), was, now, dst) */
        PyObject *key = PyTuple_GET_ITEM(row, 0);
        if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 2) {
            PyErr_Format(PyExc_TypeError, "op_tensors gave the key %R, not (pool, role)", key);
            goto fail;
        }
        PyObject *pool = PyTuple_GET_ITEM(key, 0), *role = PyTuple_GET_ITEM(key, 1);
        PyObject *ref = submission_ref(setup, sub, PyTuple_GET_ITEM(row, 3), pool, role);
        if (!ref)
            goto fail;
        PyObject *margs[5] = {pool, role, PyTuple_GET_ITEM(row, 1), PyTuple_GET_ITEM(row, 2), ref};
        PyObject *moved = PyObject_Vectorcall(setup[MV_MOVED], margs, 5, NULL);
        Py_DECREF(ref);
        PyObject *r = moved ? PyObject_CallMethodOneArg(moves, s_append, moved) : NULL;
        Py_XDECREF(moved);
        if (!r)
            goto fail;
        Py_DECREF(r);
    }
    if (changes)
        out = Py_None;
fail:
    Py_XDECREF(changes);
    Py_XDECREF(moves);
    out = lock_exit(ctx, out ? Py_NewRef(out) : NULL);
    Py_DECREF(ctx);
    if (!out)
        return -1;
    Py_DECREF(out);
    return 0;
}

static PyObject *move_hook_call(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (hook_alive(self) < 0)
        return NULL;
    PyObject *original = self->refs[0], *current = self->refs[1], *fallback = self->refs[2];
    if (PyVectorcall_NARGS(nargsf) < 1)
        return PyObject_Vectorcall(fallback, args, nargsf, kwnames);
    PyObject *sub = PyObject_GetAttr(current, s_sub);
    if (!sub)
        return NULL;
    PyObject *had = sub == Py_None ? NULL : PyObject_GetAttr(sub, s_op);
    if (sub == Py_None || !had || had != Py_None) {
        Py_DECREF(sub);
        if (!had && PyErr_Occurred())
            return NULL;
        Py_XDECREF(had);
        return PyObject_Vectorcall(original, args, nargsf, kwnames);
    }
    Py_DECREF(had);
    PyObject *const *setup = &PyTuple_GET_ITEM(self->refs[3], 0);
    PyObject *op = args[0], *before = NULL, *result = NULL, *after = NULL;
    int full = PyObject_IsTrue(setup[MV_FULL]);
    if (full < 0 || PyObject_SetAttr(sub, s_op, op) < 0)
        goto done;
    PyObject *r = full ? PyObject_CallOneArg(setup[MV_MERGED], sub) : Py_NewRef(Py_None);
    if (r && !full && PyObject_SetAttr(sub, s_merged_emitted, Py_True) < 0) /* the one event carries it */
        Py_CLEAR(r);
    Py_XDECREF(r);
    if (r)
        before = tensors_of_op(setup, op);
    if (!before && count_failure(setup[MV_FAILED], "describe an index move") < 0)
        goto done;
    result = PyObject_Vectorcall(original, args, nargsf, kwnames);
    if (!result || !before)
        goto done;
    after = tensors_of_result(setup, op, result);
    int ok = -1;
    if (after && full) {
        PyObject *rep = PyObject_CallFunctionObjArgs(setup[MV_REPORT], sub, before, after, NULL);
        ok = rep ? 0 : -1;
        Py_XDECREF(rep);
    } else if (after) {
        ok = note_moves(setup, sub, before, after);
    }
    if (ok < 0 && count_failure(setup[MV_FAILED], "describe an index move") < 0)
        Py_CLEAR(result);
done:
    Py_XDECREF(before);
    Py_XDECREF(after);
    Py_DECREF(sub);
    return result;
}

static PyObject *move_hook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *refs[4];
    static char *kw[] = {"original", "current", "fallback", "setup", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO:MoveHook", kw, &refs[0], &refs[1], &refs[2], &refs[3]))
        return NULL;
    if (!PyCallable_Check(refs[0]) || !PyCallable_Check(refs[2])) {
        PyErr_Format(PyExc_TypeError, "MoveHook(): original (the controller's move) and fallback are callables, got "
                                      "%R and %R",
                     refs[0], refs[2]);
        return NULL;
    }
    if (!PyTuple_CheckExact(refs[3]) || PyTuple_GET_SIZE(refs[3]) != MV_N) {
        PyErr_Format(PyExc_TypeError,
                     "MoveHook(): setup is a tuple of %d (full, merged, report, failed, no_torch_function, anchor, "
                     "tensor_type, pool_names, pool_name, names, device_name, moved_type, ref_type, tensor_meta, "
                     "tensor_ref), got %R",
                     MV_N, refs[3]);
        return NULL;
    }
    int callables[] = {MV_MERGED, MV_REPORT, MV_FAILED, MV_NTF, MV_POOL_NAME, MV_DEVICE_NAME,
                       MV_MOVED,  MV_REF_TYPE, MV_TENSOR_META, MV_TENSOR_REF};
    for (size_t i = 0; i < sizeof callables / sizeof callables[0]; i++)
        if (!PyCallable_Check(PyTuple_GET_ITEM(refs[3], callables[i]))) {
            PyErr_Format(PyExc_TypeError, "MoveHook(): setup's item %d is a callable, got %R", callables[i],
                         PyTuple_GET_ITEM(refs[3], callables[i]));
            return NULL;
        }
    if (!PyDict_Check(PyTuple_GET_ITEM(refs[3], MV_POOL_NAMES)) ||
        names_ok("MoveHook", PyTuple_GET_ITEM(refs[3], MV_NAMES)) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "MoveHook(): setup's pool_names is a dict");
        return NULL;
    }
    return hook_new(type, (vectorcallfunc)move_hook_call, 4, refs);
}

HOOK_TYPE(MoveHookType, "MoveHook", move_hook_new);

static PyObject *move_hook(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("move_hook", nargs, 4) < 0)
        return NULL;
    return PyObject_Vectorcall((PyObject *)&MoveHookType, args, nargs, NULL);
}

/* ---------------------------------------------------------------- submissions
 *
 * Submission(inst, direction, queued, queued_ops=None): what one start_writing /
 * start_loading call did, as the SGLang adapter's hooks observe it (the adapter subclasses
 * it): inst, direction, queued (the merged ops' ids), queued_ops (the ops as queued; a new
 * list where None), op (None), merged_emitted (False), uses ({}), records ([]), acks ([]),
 * side_moves ([]), host_indices_on_cpu ([]), sampled (False), moves ([]), copied (set()),
 * refs ({}). Every field is an attribute that can be set. */
typedef struct {
    PyObject_HEAD
    PyObject *inst, *direction, *queued, *queued_ops, *op, *merged_emitted, *uses, *records, *acks, *side_moves,
        *host_indices_on_cpu, *sampled, *moves, *copied, *refs;
} Submission;

#define SUBMISSION_FIELDS(X)                                                                                     \
    X(inst) X(direction) X(queued) X(queued_ops) X(op) X(merged_emitted) X(uses) X(records) X(acks) X(side_moves) \
        X(host_indices_on_cpu) X(sampled) X(moves) X(copied) X(refs)

static int submission_traverse(Submission *self, visitproc visit, void *arg) {
#define VISIT(f) Py_VISIT(self->f);
    SUBMISSION_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int submission_clear(Submission *self) {
#define CLEAR(f) Py_CLEAR(self->f);
    SUBMISSION_FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void submission_dealloc(Submission *self) {
    PyObject_GC_UnTrack(self);
    submission_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int submission_init(Submission *self, PyObject *args, PyObject *kwargs) {
    PyObject *inst, *direction, *queued, *queued_ops = Py_None;
    static char *kw[] = {"inst", "direction", "queued", "queued_ops", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O:Submission", kw, &inst, &direction, &queued, &queued_ops))
        return -1;
    PyObject *fresh[] = {queued_ops == Py_None ? PyList_New(0) : Py_NewRef(queued_ops), PyDict_New(), PyList_New(0),
                         PyList_New(0), PyList_New(0), PyList_New(0), PyList_New(0), PySet_New(NULL), PyDict_New()};
    int ok = 1;
    for (size_t i = 0; i < sizeof fresh / sizeof fresh[0]; i++)
        ok = ok && fresh[i];
    if (!ok) {
        for (size_t i = 0; i < sizeof fresh / sizeof fresh[0]; i++)
            Py_XDECREF(fresh[i]);
        return -1;
    }
    submission_clear(self); /* __init__ called again: a fresh start */
    self->inst = Py_NewRef(inst);
    self->direction = Py_NewRef(direction);
    self->queued = Py_NewRef(queued);
    self->queued_ops = fresh[0];
    self->op = Py_NewRef(Py_None);
    self->merged_emitted = Py_NewRef(Py_False);
    self->uses = fresh[1];
    self->records = fresh[2];
    self->acks = fresh[3];
    self->side_moves = fresh[4];
    self->host_indices_on_cpu = fresh[5];
    self->sampled = Py_NewRef(Py_False);
    self->moves = fresh[6];
    self->copied = fresh[7];
    self->refs = fresh[8];
    return 0;
}

static PyMemberDef submission_members[] = {
#define MEMBER(f) {#f, T_OBJECT_EX, offsetof(Submission, f), 0, NULL},
    SUBMISSION_FIELDS(MEMBER)
#undef MEMBER
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SubmissionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hicache_obs._slots.Submission",
    .tp_doc = "Submission(inst, direction, queued, queued_ops=None): what one start_writing / start_loading call "
              "did, as the SGLang adapter's hooks observe it.",
    .tp_basicsize = sizeof(Submission),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)submission_init,
    .tp_dealloc = (destructor)submission_dealloc,
    .tp_traverse = (traverseproc)submission_traverse,
    .tp_clear = (inquiry)submission_clear,
    .tp_members = submission_members,
};

/* StartHook(original, current, queue, setup): what the SGLang adapter puts as the
 * controller's start_writing / start_loading. setup: (owner, attribute, sub_type, inst,
 * direction, sampler, finish). A call inside a submission already (current.sub set: the
 * call re-entered), or one that finds getattr(owner, attribute) (its queue) empty, is
 * original's as it came. Else sub = sub_type(inst, direction, (int(op.id), ...), the ops
 * as queued), sub.sampled = sampler.take() where sampler is not None, current.sub = sub for
 * the length of original's call (None after it, however it ended), and finish(sub, result,
 * None) after it, or finish(sub, None, error) before its error is raised again. */
enum { ST_OWNER, ST_ATTR, ST_SUB_TYPE, ST_INST, ST_DIRECTION, ST_SAMPLER, ST_FINISH, ST_N };

/* (int(op.id), ...) of the queued ops */
static PyObject *queued_ids(PyObject *ops) {
    Py_ssize_t n = PyList_GET_SIZE(ops);
    PyObject *out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *raw = PyObject_GetAttr(PyList_GET_ITEM(ops, i), s_id);
        PyObject *id = raw ? PyNumber_Long(raw) : NULL;
        Py_XDECREF(raw);
        if (!id) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, i, id);
    }
    return out;
}

static PyObject *start_hook_call(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (hook_alive(self) < 0)
        return NULL;
    PyObject *original = self->refs[0], *current = self->refs[1];
    PyObject *const *setup = &PyTuple_GET_ITEM(self->refs[2], 0);
    PyObject *was = PyObject_GetAttr(current, s_sub);
    if (!was)
        return NULL;
    int inside = was != Py_None;
    Py_DECREF(was);
    if (inside)
        return PyObject_Vectorcall(original, args, nargsf, kwnames);
    PyObject *queue = PyObject_GetAttr(setup[ST_OWNER], setup[ST_ATTR]);
    PyObject *ops = queue ? PySequence_List(queue) : NULL;
    Py_XDECREF(queue);
    if (!ops)
        return NULL;
    if (PyList_GET_SIZE(ops) == 0) {
        Py_DECREF(ops);
        return PyObject_Vectorcall(original, args, nargsf, kwnames);
    }
    PyObject *queued = queued_ids(ops), *sub = NULL;
    if (queued) {
        PyObject *sargs[4] = {setup[ST_INST], setup[ST_DIRECTION], queued, ops};
        sub = PyObject_Vectorcall(setup[ST_SUB_TYPE], sargs, 4, NULL);
    }
    Py_XDECREF(queued);
    Py_DECREF(ops);
    if (!sub)
        return NULL;
    if (setup[ST_SAMPLER] != Py_None) {
        PyObject *picked = PyObject_CallMethodNoArgs(setup[ST_SAMPLER], s_take);
        int r = picked ? PyObject_SetAttr(sub, s_sampled, picked) : -1;
        Py_XDECREF(picked);
        if (r < 0) {
            Py_DECREF(sub);
            return NULL;
        }
    }
    if (PyObject_SetAttr(current, s_sub, sub) < 0) {
        Py_DECREF(sub);
        return NULL;
    }
    PyObject *result = PyObject_Vectorcall(original, args, nargsf, kwnames);
    PyObject *raised = result ? NULL : take_error();
    if (PyObject_SetAttr(current, s_sub, Py_None) < 0) {
        Py_XDECREF(result);
        in_context_of(raised);
        Py_DECREF(sub);
        return NULL;
    }
    PyObject *fargs[3] = {sub, result ? result : Py_None, raised ? raised : Py_None};
    PyObject *r = PyObject_Vectorcall(setup[ST_FINISH], fargs, 3, NULL);
    Py_DECREF(sub);
    if (!r) {
        Py_XDECREF(result);
        in_context_of(raised);
        return NULL;
    }
    Py_DECREF(r);
    if (raised) {
        raise_again(raised);
        return NULL;
    }
    return result;
}

static PyObject *start_hook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *refs[3];
    static char *kw[] = {"original", "current", "setup", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:StartHook", kw, &refs[0], &refs[1], &refs[2]))
        return NULL;
    PyObject *setup = refs[2];
    if (!PyCallable_Check(refs[0])) {
        PyErr_Format(PyExc_TypeError, "StartHook(): original (the controller's start) is a callable, got %R", refs[0]);
        return NULL;
    }
    if (!PyTuple_CheckExact(setup) || PyTuple_GET_SIZE(setup) != ST_N || !PyUnicode_Check(PyTuple_GET_ITEM(setup, ST_ATTR)) ||
        !PyCallable_Check(PyTuple_GET_ITEM(setup, ST_SUB_TYPE)) || !PyCallable_Check(PyTuple_GET_ITEM(setup, ST_FINISH))) {
        PyErr_Format(PyExc_TypeError,
                     "StartHook(): setup is (owner, attribute name, sub_type, inst, direction, sampler or None, finish), "
                     "sub_type and finish callables, got %R",
                     setup);
        return NULL;
    }
    return hook_new(type, (vectorcallfunc)start_hook_call, 3, refs);
}

HOOK_TYPE(StartHookType, "StartHook", start_hook_new);

static PyObject *start_hook(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("start_hook", nargs, 3) < 0)
        return NULL;
    return PyObject_Vectorcall((PyObject *)&StartHookType, args, nargs, NULL);
}

/* ---------------------------------------------------------------- queues
 *
 * OpQueue(items, on_append, on_cleared): a list (the SGLang controller's write or load
 * queue, swapped in by the adapter) whose append(op) calls on_append(op) after appending,
 * and whose clear() calls on_cleared(ops) with the ops it took, where it took any.
 * AckQueue(items, on_append, on_taken, on_cleared): a list (an ack queue) whose append(ack)
 * calls on_append(ack); pop(), remove() and del take acks out, each then on_taken(ack) in
 * queue order; clear() calls on_cleared(ack) for each ack it took, in queue order. Every
 * other list operation is the list's own. A callback's error is raised after the list
 * changed. */
typedef struct {
    PyListObject list;
    PyObject *on_append, *on_taken, *on_cleared; /* on_taken: NULL in an OpQueue */
} Queue;

static int queue_traverse(Queue *self, visitproc visit, void *arg) {
    Py_VISIT(self->on_append);
    Py_VISIT(self->on_taken);
    Py_VISIT(self->on_cleared);
    return PyList_Type.tp_traverse((PyObject *)self, visit, arg);
}

static int queue_clear_refs(Queue *self) {
    Py_CLEAR(self->on_append);
    Py_CLEAR(self->on_taken);
    Py_CLEAR(self->on_cleared);
    return PyList_Type.tp_clear((PyObject *)self);
}

static void queue_dealloc(Queue *self) {
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->on_append);
    Py_CLEAR(self->on_taken);
    Py_CLEAR(self->on_cleared);
    PyList_Type.tp_dealloc((PyObject *)self);
}

static int queue_set_callbacks(Queue *self, PyObject *const *cbs, int n, const char *type) {
    for (int i = 0; i < n; i++)
        if (!PyCallable_Check(cbs[i])) {
            PyErr_Format(PyExc_TypeError, "%s(): the callbacks are callables, got %R", type, cbs[i]);
            return -1;
        }
    Py_XSETREF(self->on_append, Py_NewRef(cbs[0]));
    if (n == 3) {
        Py_XSETREF(self->on_taken, Py_NewRef(cbs[1]));
        Py_XSETREF(self->on_cleared, Py_NewRef(cbs[2]));
    } else {
        Py_XSETREF(self->on_cleared, Py_NewRef(cbs[1]));
    }
    return 0;
}

/* list.__init__(self, items), then the callbacks */
static int queue_init_items(Queue *self, PyObject *items) {
    PyObject *args = PyTuple_Pack(1, items);
    if (!args)
        return -1;
    int r = PyList_Type.tp_init((PyObject *)self, args, NULL);
    Py_DECREF(args);
    return r;
}

static int op_queue_init(Queue *self, PyObject *args, PyObject *kwargs) {
    PyObject *items, *cbs[2];
    static char *kw[] = {"items", "on_append", "on_cleared", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:OpQueue", kw, &items, &cbs[0], &cbs[1]))
        return -1;
    if (queue_set_callbacks(self, cbs, 2, "OpQueue") < 0)
        return -1;
    return queue_init_items(self, items);
}

static int ack_queue_init(Queue *self, PyObject *args, PyObject *kwargs) {
    PyObject *items, *cbs[3];
    static char *kw[] = {"items", "on_append", "on_taken", "on_cleared", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO:AckQueue", kw, &items, &cbs[0], &cbs[1], &cbs[2]))
        return -1;
    if (queue_set_callbacks(self, cbs, 3, "AckQueue") < 0)
        return -1;
    return queue_init_items(self, items);
}

/* cb(item); NULL with an error */
static PyObject *queue_tell(PyObject *cb, PyObject *item) {
    if (!cb) {
        PyErr_SetString(PyExc_RuntimeError, "a queue whose __init__ did not run");
        return NULL;
    }
    PyObject *r = PyObject_CallOneArg(cb, item);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *queue_append(Queue *self, PyObject *item) {
    if (PyList_Append((PyObject *)self, item) < 0)
        return NULL;
    return queue_tell(self->on_append, item);
}

/* clear(): the items taken, then on_cleared(items) (an OpQueue, where it took any) or
 * on_cleared(item) for each (an AckQueue) */
static PyObject *queue_clear(Queue *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *taken = PyList_GetSlice((PyObject *)self, 0, PY_SSIZE_T_MAX);
    if (!taken)
        return NULL;
    if (PyList_SetSlice((PyObject *)self, 0, PY_SSIZE_T_MAX, NULL) < 0) {
        Py_DECREF(taken);
        return NULL;
    }
    PyObject *r = Py_NewRef(Py_None);
    if (!self->on_taken) {
        if (PyList_GET_SIZE(taken)) {
            Py_DECREF(r);
            r = queue_tell(self->on_cleared, taken);
        }
    } else {
        for (Py_ssize_t i = 0; r && i < PyList_GET_SIZE(taken); i++) {
            Py_DECREF(r);
            r = queue_tell(self->on_cleared, PyList_GET_ITEM(taken, i));
        }
    }
    Py_DECREF(taken);
    return r;
}

static PyObject *list_pop, *list_remove; /* list.pop, list.remove: read once when the module loads */

static PyObject *ack_queue_pop(Queue *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "pop expected at most 1 argument, got %zd", nargs);
        return NULL;
    }
    PyObject *full[2] = {(PyObject *)self, nargs ? args[0] : NULL};
    PyObject *ack = PyObject_Vectorcall(list_pop, full, 1 + nargs, NULL);
    if (!ack)
        return NULL;
    PyObject *r = queue_tell(self->on_taken, ack);
    if (!r) {
        Py_DECREF(ack);
        return NULL;
    }
    Py_DECREF(r);
    return ack;
}

static PyObject *ack_queue_remove(Queue *self, PyObject *ack) {
    PyObject *full[2] = {(PyObject *)self, ack};
    PyObject *r = PyObject_Vectorcall(list_remove, full, 2, NULL);
    if (!r)
        return NULL;
    Py_DECREF(r);
    return queue_tell(self->on_taken, ack);
}

/* self[key] = value as the list does it; del self[key]: the acks taken, then on_taken for each */
static int ack_queue_ass_subscript(Queue *self, PyObject *key, PyObject *value) {
    if (value)
        return PyList_Type.tp_as_mapping->mp_ass_subscript((PyObject *)self, key, value);
    PyObject *got = PyList_Type.tp_as_mapping->mp_subscript((PyObject *)self, key);
    if (!got)
        return -1;
    PyObject *taken = PySlice_Check(key) ? got : PyList_New(1);
    if (!taken) {
        Py_DECREF(got);
        return -1;
    }
    if (taken != got)
        PyList_SET_ITEM(taken, 0, got);
    if (PyList_Type.tp_as_mapping->mp_ass_subscript((PyObject *)self, key, NULL) < 0) {
        Py_DECREF(taken);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(taken); i++) {
        PyObject *r = queue_tell(self->on_taken, PyList_GET_ITEM(taken, i));
        if (!r) {
            Py_DECREF(taken);
            return -1;
        }
        Py_DECREF(r);
    }
    Py_DECREF(taken);
    return 0;
}

static PyObject *queue_reduce(Queue *self, PyObject *Py_UNUSED(ignored)) {
    PyErr_Format(PyExc_TypeError, "cannot copy %s: it observes a live controller's queue", Py_TYPE(self)->tp_name);
    return NULL;
}

static PyMethodDef op_queue_methods[] = {
    {"append", (PyCFunction)queue_append, METH_O, "Append an op, then on_append(op)."},
    {"clear", (PyCFunction)queue_clear, METH_NOARGS, "Remove every op, then on_cleared(ops) where there were any."},
    {"__reduce__", (PyCFunction)queue_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef ack_queue_methods[] = {
    {"append", (PyCFunction)queue_append, METH_O, "Append an ack, then on_append(ack)."},
    {"pop", (PyCFunction)(void (*)(void))ack_queue_pop, METH_FASTCALL, "Take an ack out (the last by default), then "
                                                                       "on_taken(ack)."},
    {"remove", (PyCFunction)ack_queue_remove, METH_O, "Take an ack out, then on_taken(ack)."},
    {"clear", (PyCFunction)queue_clear, METH_NOARGS, "Remove every ack, then on_cleared(ack) for each, in order."},
    {"__reduce__", (PyCFunction)queue_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods ack_queue_mapping;

static PyTypeObject OpQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hicache_obs._slots.OpQueue",
    .tp_doc = "OpQueue(items, on_append, on_cleared): a list whose append and clear report what they did.",
    .tp_basicsize = sizeof(Queue),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_LIST_SUBCLASS,
    .tp_init = (initproc)op_queue_init,
    .tp_dealloc = (destructor)queue_dealloc,
    .tp_traverse = (traverseproc)queue_traverse,
    .tp_clear = (inquiry)queue_clear_refs,
    .tp_methods = op_queue_methods,
};

static PyTypeObject AckQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hicache_obs._slots.AckQueue",
    .tp_doc = "AckQueue(items, on_append, on_taken, on_cleared): a list whose append, pop, remove, del and clear "
              "report the acks they added or took.",
    .tp_basicsize = sizeof(Queue),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_LIST_SUBCLASS,
    .tp_init = (initproc)ack_queue_init,
    .tp_dealloc = (destructor)queue_dealloc,
    .tp_traverse = (traverseproc)queue_traverse,
    .tp_clear = (inquiry)queue_clear_refs,
    .tp_methods = ack_queue_methods,
    .tp_as_mapping = &ack_queue_mapping,
};

/* Stamp(times, clock): a callable that notes times[id(x)] = clock() for each x it is called with.
 * refs: (times, clock) */
static PyObject *stamp_call(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames) {
        PyErr_SetString(PyExc_TypeError, "Stamp() takes the one object it stamps");
        return NULL;
    }
    if (hook_alive(self) < 0)
        return NULL;
    PyObject *now = PyObject_CallNoArgs(self->refs[1]);
    PyObject *key = now ? PyLong_FromVoidPtr(args[0]) : NULL;
    int r = key ? PyObject_SetItem(self->refs[0], key, now) : -1;
    Py_XDECREF(now);
    Py_XDECREF(key);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *stamp_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *refs[2];
    static char *kw[] = {"times", "clock", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:Stamp", kw, &refs[0], &refs[1]))
        return NULL;
    if (!PyDict_Check(refs[0]) || !PyCallable_Check(refs[1])) {
        PyErr_Format(PyExc_TypeError, "Stamp(): times is a dict and clock a callable, got %R and %R", refs[0], refs[1]);
        return NULL;
    }
    return hook_new(type, (vectorcallfunc)stamp_call, 2, refs);
}

CALLBACK_TYPE(StampType, "Stamp", stamp_new, "Stamp(times, clock): called with x, notes times[id(x)] = clock().");

/* AckNote(current, direction, failed): the ack queue's on_append: an ack appended inside a
 * submission of this direction (current.sub.direction) joins current.sub.acks. A failure is
 * failed("note an ack of a submission"), never raised into the append.
 * refs: (current, direction, failed) */
static PyObject *ack_note_call(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames) {
        PyErr_SetString(PyExc_TypeError, "AckNote() takes the one ack appended");
        return NULL;
    }
    if (hook_alive(self) < 0)
        return NULL;
    int r = -1;
    PyObject *sub = PyObject_GetAttr(self->refs[0], s_sub);
    if (sub == Py_None) {
        r = 0;
    } else if (sub) {
        PyObject *direction = PyObject_GetAttr(sub, s_direction);
        int mine = direction ? PyObject_RichCompareBool(direction, self->refs[1], Py_EQ) : -1;
        Py_XDECREF(direction);
        PyObject *acks = mine > 0 ? PyObject_GetAttr(sub, s_acks) : NULL;
        PyObject *done = acks ? PyObject_CallMethodOneArg(acks, s_append, args[0]) : NULL;
        Py_XDECREF(acks);
        Py_XDECREF(done);
        r = mine == 0 ? 0 : done ? 0 : -1;
    }
    Py_XDECREF(sub);
    if (r < 0 && count_failure(self->refs[2], "note an ack of a submission") < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *ack_note_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *refs[3];
    static char *kw[] = {"current", "direction", "failed", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:AckNote", kw, &refs[0], &refs[1], &refs[2]))
        return NULL;
    if (!PyCallable_Check(refs[2])) {
        PyErr_Format(PyExc_TypeError, "AckNote(): failed is a callable, got %R", refs[2]);
        return NULL;
    }
    return hook_new(type, (vectorcallfunc)ack_note_call, 3, refs);
}

CALLBACK_TYPE(AckNoteType, "AckNote", ack_note_new,
              "AckNote(current, direction, failed): called with an ack appended, adds it to current.sub.acks where "
              "current.sub is a submission of this direction.");

/* FinishHook(fallback, setup): the end of a submission under the SGLang adapter's metrics
 * and sampling profiles, called (sub, result, error) once the controller's start returned or
 * raised. A submission that raised, has no op, or is sampled is fallback's. Else, with torch
 * function dispatch off: the TensorRef of each tensor its copies received (use_refs, cached
 * in sub.refs), the time, the pools' occupancy where usage is not empty and every_ns passed
 * since state.pools_at (then set to now), its one event (submission_event, with
 * state.event_setup) and its acks awaiting completion (pending[id(ack)] = (op, direction)).
 * A failed event is counted ("record an OpsSubmitted event") and the acks still await; a step
 * before it that fails is counted ("describe a submission") and the acks do not. Then sync()
 * where state.durable is set.
 * setup: (state, failed, no_torch_function, ref_type, names, tensor_meta, clock, usage,
 *         pool_usage, every_ns, pending, sync, emit, cls) */
enum { FN_STATE, FN_FAILED, FN_NTF, FN_REF_TYPE, FN_NAMES, FN_TENSOR_META, FN_CLOCK, FN_USAGE, FN_POOL_USAGE,
       FN_EVERY, FN_PENDING, FN_SYNC, FN_EMIT, FN_CLS, FN_N };

static PyObject *use_refs(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs);
static PyObject *submission_event(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs);

/* The pools' occupancy due now, or (); new reference */
static PyObject *pools_due(PyObject *const *setup, PyObject *now) {
    int any = PyObject_IsTrue(setup[FN_USAGE]);
    if (any <= 0)
        return any < 0 ? NULL : PyTuple_New(0);
    PyObject *at = PyObject_GetAttr(setup[FN_STATE], s_pools_at);
    PyObject *since = at ? PyNumber_Subtract(now, at) : NULL;
    int due = since ? PyObject_RichCompareBool(since, setup[FN_EVERY], Py_GE) : -1;
    Py_XDECREF(at);
    Py_XDECREF(since);
    if (due <= 0)
        return due < 0 ? NULL : PyTuple_New(0);
    if (PyObject_SetAttr(setup[FN_STATE], s_pools_at, now) < 0)
        return NULL;
    return PyObject_CallNoArgs(setup[FN_POOL_USAGE]);
}

/* The submission's description and event (see FinishHook). 0: described (event counted where
 * it failed); -1 with an error: a step before the event failed. */
static int finish_described(PyObject *const *setup, PyObject *sub, PyObject *op, PyObject *result) {
    PyObject *raw = PyObject_GetAttr(op, s_id), *op_id = raw ? PyNumber_Long(raw) : NULL;
    Py_XDECREF(raw);
    PyObject *uses = op_id ? PyObject_GetAttr(sub, s_uses) : NULL;
    PyObject *cache = uses ? PyObject_GetAttr(sub, s_refs) : NULL;
    PyObject *rargs[5] = {uses, cache, setup[FN_REF_TYPE], setup[FN_NAMES], setup[FN_TENSOR_META]};
    PyObject *refs = cache ? use_refs(NULL, rargs, 5) : NULL;
    Py_XDECREF(uses);
    Py_XDECREF(cache);
    PyObject *now = refs ? PyObject_CallNoArgs(setup[FN_CLOCK]) : NULL;
    PyObject *pools = now ? pools_due(setup, now) : NULL;
    PyObject *ev_setup = pools ? PyObject_GetAttr(setup[FN_STATE], s_event_setup) : NULL;
    PyObject *direction = ev_setup ? PyObject_GetAttr(sub, s_direction) : NULL;
    PyObject *acks = direction ? PyObject_GetAttr(sub, s_acks) : NULL;
    PyObject *awaits = acks ? PyTuple_Pack(2, op_id, direction) : NULL;
    int r = -1;
    if (awaits) {
        PyObject *eargs[9] = {setup[FN_EMIT], setup[FN_CLS], sub, op_id, refs, result, now, pools, ev_setup};
        PyObject *ev = submission_event(NULL, eargs, 9);
        if (ev || count_failure(setup[FN_FAILED], "record an OpsSubmitted event") == 0) {
            r = 0;
            PyObject *it = PyObject_GetIter(acks), *ack;
            while (it && (ack = PyIter_Next(it))) {
                PyObject *key = PyLong_FromVoidPtr(ack);
                int set = key ? PyObject_SetItem(setup[FN_PENDING], key, awaits) : -1;
                Py_XDECREF(key);
                Py_DECREF(ack);
                if (set < 0)
                    break;
            }
            Py_XDECREF(it);
            if (PyErr_Occurred())
                r = -1;
        }
        Py_XDECREF(ev);
    }
    Py_XDECREF(op_id);
    Py_XDECREF(refs);
    Py_XDECREF(now);
    Py_XDECREF(pools);
    Py_XDECREF(ev_setup);
    Py_XDECREF(direction);
    Py_XDECREF(acks);
    Py_XDECREF(awaits);
    return r;
}

static PyObject *finish_hook_call(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames) {
        PyErr_SetString(PyExc_TypeError, "FinishHook() takes (sub, result, error)");
        return NULL;
    }
    if (hook_alive(self) < 0)
        return NULL;
    PyObject *sub = args[0], *result = args[1], *error = args[2];
    PyObject *const *setup = &PyTuple_GET_ITEM(self->refs[1], 0);
    if (error != Py_None)
        return PyObject_Vectorcall(self->refs[0], args, 3, NULL);
    PyObject *op = PyObject_GetAttr(sub, s_op);
    if (!op)
        return NULL;
    PyObject *sampled = op == Py_None ? NULL : PyObject_GetAttr(sub, s_sampled);
    int values = sampled ? PyObject_IsTrue(sampled) : -1;
    Py_XDECREF(sampled);
    if (op == Py_None || values != 0) {
        Py_DECREF(op);
        if (values < 0 && PyErr_Occurred())
            return NULL;
        return PyObject_Vectorcall(self->refs[0], args, 3, NULL);
    }
    PyObject *ctx = PyObject_CallNoArgs(setup[FN_NTF]);
    PyObject *entered = ctx ? PyObject_VectorcallMethod(s_enter, &ctx, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL) : NULL;
    PyObject *out = NULL;
    if (entered) {
        Py_DECREF(entered);
        out = finish_described(setup, sub, op, result) == 0 ? Py_NewRef(Py_None) : NULL;
        out = lock_exit(ctx, out);
    }
    Py_XDECREF(ctx);
    Py_DECREF(op);
    if (!out) {
        if (count_failure(setup[FN_FAILED], "describe a submission") < 0)
            return NULL;
        out = Py_NewRef(Py_None);
    }
    PyObject *durable = PyObject_GetAttr(setup[FN_STATE], s_durable);
    if (!durable) {
        Py_DECREF(out);
        return NULL;
    }
    int none = durable == Py_None;
    Py_DECREF(durable);
    if (!none) {
        PyObject *r = PyObject_CallNoArgs(setup[FN_SYNC]);
        if (!r) {
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(r);
    }
    return out;
}

static PyObject *finish_hook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *fallback, *setup;
    static char *kw[] = {"fallback", "setup", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:FinishHook", kw, &fallback, &setup))
        return NULL;
    if (!PyCallable_Check(fallback) || !PyTuple_CheckExact(setup) || PyTuple_GET_SIZE(setup) != FN_N) {
        PyErr_Format(PyExc_TypeError,
                     "FinishHook(): fallback is a callable and setup a tuple of %d (state, failed, no_torch_function, "
                     "ref_type, names, tensor_meta, clock, usage, pool_usage, every_ns, pending, sync, emit, cls), "
                     "got %R and %R",
                     FN_N, fallback, setup);
        return NULL;
    }
    int callables[] = {FN_FAILED, FN_NTF, FN_REF_TYPE, FN_TENSOR_META, FN_CLOCK, FN_POOL_USAGE, FN_SYNC, FN_EMIT};
    for (size_t i = 0; i < sizeof callables / sizeof callables[0]; i++)
        if (!PyCallable_Check(PyTuple_GET_ITEM(setup, callables[i]))) {
            PyErr_Format(PyExc_TypeError, "FinishHook(): setup's item %d is a callable, got %R", callables[i],
                         PyTuple_GET_ITEM(setup, callables[i]));
            return NULL;
        }
    if (names_ok("FinishHook", PyTuple_GET_ITEM(setup, FN_NAMES)) < 0)
        return NULL;
    if (!PyDict_Check(PyTuple_GET_ITEM(setup, FN_PENDING))) {
        PyErr_Format(PyExc_TypeError, "FinishHook(): setup's pending is a dict, got %R", PyTuple_GET_ITEM(setup, FN_PENDING));
        return NULL;
    }
    PyObject *refs[2] = {fallback, setup};
    return hook_new(type, (vectorcallfunc)finish_hook_call, 2, refs);
}

CALLBACK_TYPE(FinishHookType, "FinishHook", finish_hook_new,
              "FinishHook(fallback, setup): the end of a submission under the SGLang adapter's metrics and sampling "
              "profiles, called (sub, result, error) (see the module source).");

/* AckTaken(fallback, setup): an ack queue's on_taken under the SGLang adapter's metrics and
 * sampling profiles, called with the ack taken out. An ack no op awaits (not in pending) is
 * nothing; one whose op holds device tensors (held not empty) or that times its copy
 * (ack.timing_enabled true) is fallback's. Else its op's completion: pending's entry (op,
 * direction) taken, emit(cls, op=op, direction=direction, duration_ns=0) (a failure counted:
 * "record a TransferCompleted event"), then sync() where state.durable is set.
 * setup: (pending, held, state, emit, cls, failed, sync)
 *
 * QueueCleared(fallback, setup): a write or load queue's on_cleared under the same profiles,
 * called with the ops a clear() took. The usual clear (outside a reset, by the submission of
 * this direction that merged exactly these ops, current.sub.queued_ops, or with no queue time
 * noted at all) is nothing; any other is fallback's.
 * setup: (direction, resetting, queued_at, current) */
enum { AT_PENDING, AT_HELD, AT_STATE, AT_EMIT, AT_CLS, AT_FAILED, AT_SYNC, AT_N };
enum { QC_DIRECTION, QC_RESETTING, QC_QUEUED_AT, QC_CURRENT, QC_N };

static PyObject *ack_taken_call(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames) {
        PyErr_SetString(PyExc_TypeError, "AckTaken() takes the ack taken out");
        return NULL;
    }
    if (hook_alive(self) < 0)
        return NULL;
    PyObject *const *setup = &PyTuple_GET_ITEM(self->refs[1], 0);
    PyObject *ack = args[0], *key = PyLong_FromVoidPtr(ack);
    if (!key)
        return NULL;
    PyObject *awaits = PyDict_GetItemWithError(setup[AT_PENDING], key); /* borrowed */
    if (!awaits) {
        Py_DECREF(key);
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    int slow = PyObject_IsTrue(setup[AT_HELD]);
    if (slow == 0) {
        PyObject *timing = attr_or_none(ack, s_timing_enabled);
        slow = timing ? PyObject_IsTrue(timing) : -1;
        Py_XDECREF(timing);
    }
    if (slow != 0) {
        Py_DECREF(key);
        return slow < 0 ? NULL : PyObject_Vectorcall(self->refs[0], args, 1, NULL);
    }
    Py_INCREF(awaits);
    int gone = PyDict_DelItem(setup[AT_PENDING], key);
    Py_DECREF(key);
    if (gone < 0) {
        Py_DECREF(awaits);
        return NULL;
    }
    PyObject *ev = NULL;
    if (PyTuple_Check(awaits) && PyTuple_GET_SIZE(awaits) == 2) {
        PyObject *eargs[4] = {setup[AT_CLS], PyTuple_GET_ITEM(awaits, 0), PyTuple_GET_ITEM(awaits, 1), s_zero};
        ev = PyObject_Vectorcall(setup[AT_EMIT], eargs, 1, s_completed_kwnames);
    } else {
        PyErr_Format(PyExc_TypeError, "pending holds (op, direction), got %R", awaits);
    }
    Py_DECREF(awaits);
    if (ev)
        Py_DECREF(ev);
    else if (count_failure(setup[AT_FAILED], "record a TransferCompleted event") < 0)
        return NULL;
    PyObject *durable = PyObject_GetAttr(setup[AT_STATE], s_durable);
    if (!durable)
        return NULL;
    int none = durable == Py_None;
    Py_DECREF(durable);
    if (!none) {
        PyObject *r = PyObject_CallNoArgs(setup[AT_SYNC]);
        if (!r)
            return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

/* 1 where two lists hold the same objects in the same order, 0 where not, -1 with an error */
static int same_objects(PyObject *a, PyObject *b) {
    if (!PyList_Check(a) || !PyList_Check(b)) {
        PyErr_SetString(PyExc_TypeError, "the merged ops and the ops cleared are lists");
        return -1;
    }
    if (PyList_GET_SIZE(a) != PyList_GET_SIZE(b))
        return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(a); i++)
        if (PyList_GET_ITEM(a, i) != PyList_GET_ITEM(b, i))
            return 0;
    return 1;
}

static PyObject *queue_cleared_call(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames) {
        PyErr_SetString(PyExc_TypeError, "QueueCleared() takes the ops a clear() took");
        return NULL;
    }
    if (hook_alive(self) < 0)
        return NULL;
    PyObject *const *setup = &PyTuple_GET_ITEM(self->refs[1], 0);
    PyObject *depth = PyObject_GetAttr(setup[QC_RESETTING], s_depth);
    int resetting = depth ? PyObject_IsTrue(depth) : -1;
    Py_XDECREF(depth);
    if (resetting != 0)
        return resetting < 0 ? NULL : PyObject_Vectorcall(self->refs[0], args, 1, NULL);
    int noted = PyObject_IsTrue(setup[QC_QUEUED_AT]);
    if (noted <= 0) {
        if (noted < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *sub = PyObject_GetAttr(setup[QC_CURRENT], s_sub);
    if (!sub)
        return NULL;
    int usual = 0;
    if (sub != Py_None) {
        PyObject *direction = PyObject_GetAttr(sub, s_direction);
        int mine = direction ? PyObject_RichCompareBool(direction, setup[QC_DIRECTION], Py_EQ) : -1;
        Py_XDECREF(direction);
        PyObject *ops = mine > 0 ? PyObject_GetAttr(sub, s_queued_ops) : NULL;
        usual = mine > 0 ? (ops ? same_objects(ops, args[0]) : -1) : mine;
        Py_XDECREF(ops);
    }
    Py_DECREF(sub);
    if (usual != 0)
        return usual < 0 ? NULL : Py_NewRef(Py_None);
    return PyObject_Vectorcall(self->refs[0], args, 1, NULL);
}

static PyObject *callback_new(PyTypeObject *type, PyObject *args, PyObject *kwargs, const char *name, Py_ssize_t n,
                              vectorcallfunc call) {
    PyObject *fallback, *setup;
    static char *kw[] = {"fallback", "setup", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO", kw, &fallback, &setup))
        return NULL;
    if (!PyCallable_Check(fallback) || !PyTuple_CheckExact(setup) || PyTuple_GET_SIZE(setup) != n) {
        PyErr_Format(PyExc_TypeError, "%s(): fallback is a callable and setup a tuple of %zd, got %R and %R", name, n,
                     fallback, setup);
        return NULL;
    }
    PyObject *refs[2] = {fallback, setup};
    return hook_new(type, call, 2, refs);
}

static PyObject *ack_taken_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *self = callback_new(type, args, kwargs, "AckTaken", AT_N, (vectorcallfunc)ack_taken_call);
    if (!self)
        return NULL;
    PyObject *setup = ((Hook *)self)->refs[1];
    if (!PyDict_Check(PyTuple_GET_ITEM(setup, AT_PENDING)) || !PyCallable_Check(PyTuple_GET_ITEM(setup, AT_EMIT)) ||
        !PyCallable_Check(PyTuple_GET_ITEM(setup, AT_FAILED)) || !PyCallable_Check(PyTuple_GET_ITEM(setup, AT_SYNC))) {
        PyErr_Format(PyExc_TypeError, "AckTaken(): setup is (pending dict, held, state, emit, cls, failed, sync), "
                                      "emit, failed and sync callables, got %R",
                     setup);
        Py_DECREF(self);
        return NULL;
    }
    return self;
}

static PyObject *queue_cleared_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    return callback_new(type, args, kwargs, "QueueCleared", QC_N, (vectorcallfunc)queue_cleared_call);
}

CALLBACK_TYPE(AckTakenType, "AckTaken", ack_taken_new,
              "AckTaken(fallback, setup): an ack queue's on_taken under the SGLang adapter's metrics and sampling "
              "profiles (see the module source).");
CALLBACK_TYPE(QueueClearedType, "QueueCleared", queue_cleared_new,
              "QueueCleared(fallback, setup): a write or load queue's on_cleared under the SGLang adapter's metrics "
              "and sampling profiles (see the module source).");

/* The exception being raised, taken (normalized, its traceback on it); NULL where none is. */
static PyObject *take_error(void) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (!t)
        return NULL;
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb && v)
        PyException_SetTraceback(v, tb);
    Py_XDECREF(t);
    Py_XDECREF(tb);
    return v;
}

/* Raise v (an exception taken by take_error) again, as it was; steals v. */
static void raise_again(PyObject *v) {
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(v)), v, PyException_GetTraceback(v));
}

/* Raise the exception being raised with `context` as its __context__ (as Python does for an
 * error in a finally block or an __exit__); steals context. */
static void in_context_of(PyObject *context) {
    if (!context)
        return;
    PyObject *v = take_error();
    if (!v) {
        Py_DECREF(context);
        return;
    }
    PyException_SetContext(v, context);
    raise_again(v);
}

/* `try: <call that gave out> finally: watch.depth = 0` (out NULL: it raised). */
static PyObject *depth_reset(PyObject *watch, PyObject *out) {
    PyObject *raised = out ? NULL : take_error();
    if (PyObject_SetAttr(watch, s_depth, s_zero) < 0) {
        Py_XDECREF(out);
        in_context_of(raised);
        return NULL;
    }
    if (raised)
        raise_again(raised);
    return out;
}

/* The end of `with lock:` around a call that gave out (NULL: it raised): lock.__exit__ with
 * that exception, or three Nones. A true answer swallows the exception (the call then gives
 * None); an error of __exit__ is raised in the context of the call's. */
static PyObject *lock_exit(PyObject *lock, PyObject *out) {
    PyObject *raised = out ? NULL : take_error();
    PyObject *args[4] = {lock, Py_None, Py_None, Py_None};
    if (raised) {
        args[1] = (PyObject *)Py_TYPE(raised);
        args[2] = raised;
        PyObject *tb = PyException_GetTraceback(raised); /* new reference, or NULL */
        args[3] = tb ? tb : Py_None;
        PyObject *r = PyObject_VectorcallMethod(s_exit, args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_XDECREF(tb);
        int swallow = r ? PyObject_IsTrue(r) : -1;
        Py_XDECREF(r);
        if (swallow < 0) {
            in_context_of(raised);
            return NULL;
        }
        if (swallow) {
            Py_DECREF(raised);
            Py_RETURN_NONE;
        }
        raise_again(raised);
        return NULL;
    }
    PyObject *r = PyObject_VectorcallMethod(s_exit, args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (!r) {
        Py_DECREF(out);
        return NULL;
    }
    Py_DECREF(r);
    return out;
}

/* SlotGuard(original, hook, watch, lock): what the SGLang adapter puts as an allocator call
 * that can change its free lists. A call holds lock (`with lock:`); inside another such call
 * (watch.depth true: an allocation's own merge, a group's free inside its end) it is
 * original's as it came; else hook's, with watch.depth 1 for its length, 0 after. */
static PyObject *slot_guard_call(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (hook_alive(self) < 0)
        return NULL;
    PyObject *original = Py_NewRef(self->refs[0]), *hook = Py_NewRef(self->refs[1]);
    PyObject *watch = Py_NewRef(self->refs[2]), *lock = Py_NewRef(self->refs[3]);
    PyObject *out = NULL;
    PyObject *entered = PyObject_VectorcallMethod(s_enter, &lock, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (!entered)
        goto done;
    Py_DECREF(entered);
    PyObject *depth = PyObject_GetAttr(watch, s_depth);
    int busy = depth ? PyObject_IsTrue(depth) : -1;
    Py_XDECREF(depth);
    if (busy > 0) {
        out = PyObject_Vectorcall(original, args, nargsf, kwnames);
    } else if (busy == 0 && PyObject_SetAttr(watch, s_depth, s_one) == 0) {
        out = PyObject_Vectorcall(hook, args, nargsf, kwnames);
        out = depth_reset(watch, out);
    }
    out = lock_exit(lock, out);
done:
    Py_DECREF(original);
    Py_DECREF(hook);
    Py_DECREF(watch);
    Py_DECREF(lock);
    return out;
}

static PyObject *slot_guard_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *refs[4];
    static char *kw[] = {"original", "hook", "watch", "lock", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO:SlotGuard", kw, &refs[0], &refs[1], &refs[2], &refs[3]))
        return NULL;
    if (!PyCallable_Check(refs[0]) || !PyCallable_Check(refs[1])) {
        PyErr_Format(PyExc_TypeError, "SlotGuard(): original (the allocator's call) and hook are callables, got %R and %R",
                     refs[0], refs[1]);
        return NULL;
    }
    return hook_new(type, (vectorcallfunc)slot_guard_call, 4, refs);
}

HOOK_TYPE(SlotGuardType, "SlotGuard", slot_guard_new);

static PyObject *slot_guard(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("slot_guard", nargs, 4) < 0)
        return NULL;
    return PyObject_CallFunctionObjArgs((PyObject *)&SlotGuardType, args[0], args[1], args[2], args[3], NULL);
}

/* ConversionObserver(method, src, role, watch, tensor_type): what the SGLang adapter's
 * conversion watch puts as src.to / src.cuda for the length of one copy call. A call is
 * method(src, ...) as it came; where that returned a tensor_type other than src, on the
 * watch's thread (watch.thread, a thread ident), for a role not in watch.known,
 * watch.describe(src, out, role) describes it. The call returns what method returned. */
static PyObject *conversion_call(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (hook_alive(self) < 0)
        return NULL;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *small[8], **full = small;
    if (nargs + nkw + 1 > 8 && !(full = PyMem_Malloc((nargs + nkw + 1) * sizeof(PyObject *))))
        return PyErr_NoMemory();
    /* held while Python code runs: the watch takes the observer off when the copy ends */
    PyObject *method = Py_NewRef(self->refs[0]), *src = Py_NewRef(self->refs[1]), *role = Py_NewRef(self->refs[2]);
    PyObject *watch = Py_NewRef(self->refs[3]), *tensor_type = Py_NewRef(self->refs[4]);
    full[0] = src;
    for (Py_ssize_t i = 0; i < nargs + nkw; i++)
        full[i + 1] = args[i];
    PyObject *out = PyObject_Vectorcall(method, full, nargs + 1, kwnames);
    if (full != small)
        PyMem_Free(full);
    if (!out || out == src)
        goto done;
    int is = PyObject_IsInstance(out, tensor_type);
    if (is <= 0) {
        if (is < 0)
            Py_CLEAR(out);
        goto done;
    }
    PyObject *thread = PyObject_GetAttr(watch, s_thread);
    if (!thread) {
        Py_CLEAR(out);
        goto done;
    }
    unsigned long ident = PyLong_AsUnsignedLong(thread);
    Py_DECREF(thread);
    if (ident == (unsigned long)-1 && PyErr_Occurred()) {
        Py_CLEAR(out);
        goto done;
    }
    if (ident != PyThread_get_thread_ident())
        goto done;
    PyObject *known = PyObject_GetAttr(watch, s_known);
    int seen = known ? PySequence_Contains(known, role) : -1;
    Py_XDECREF(known);
    if (seen) {
        if (seen < 0)
            Py_CLEAR(out);
        goto done;
    }
    PyObject *r = PyObject_CallMethodObjArgs(watch, s_describe, src, out, role, NULL);
    if (!r)
        Py_CLEAR(out);
    Py_XDECREF(r);
done:
    Py_DECREF(method);
    Py_DECREF(src);
    Py_DECREF(role);
    Py_DECREF(watch);
    Py_DECREF(tensor_type);
    return out;
}

static PyObject *conversion_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *refs[5];
    static char *kw[] = {"method", "src", "role", "watch", "tensor_type", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO:ConversionObserver", kw, &refs[0], &refs[1], &refs[2],
                                     &refs[3], &refs[4]))
        return NULL;
    if (!PyCallable_Check(refs[0])) {
        PyErr_Format(PyExc_TypeError, "ConversionObserver(): method is torch.Tensor's to or cuda, got %R", refs[0]);
        return NULL;
    }
    return hook_new(type, (vectorcallfunc)conversion_call, 5, refs);
}

HOOK_TYPE(ConversionObserverType, "ConversionObserver", conversion_new);

static PyObject *conversion_observer(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("conversion_observer", nargs, 5) < 0)
        return NULL;
    return PyObject_CallFunctionObjArgs((PyObject *)&ConversionObserverType, args[0], args[1], args[2], args[3],
                                        args[4], NULL);
}

/* place_observers(watched, methods, tensor_type, watch, placed): the conversion watch's
 * entry. For each (role, tensor) of watched.values() that has a __dict__, and each name of
 * methods not in it already, tensor.__dict__[name] = ConversionObserver(getattr(tensor_type,
 * name), tensor, role, watch, tensor_type), and (tensor, name) appended to placed. */
static PyObject *place_observers(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("place_observers", nargs, 5) < 0)
        return NULL;
    PyObject *watched = args[0], *methods = args[1], *tensor_type = args[2], *watch = args[3], *placed = args[4];
    if (!PyDict_Check(watched) || !PyTuple_Check(methods) || !PyList_Check(placed)) {
        PyErr_SetString(PyExc_TypeError, "place_observers(): watched is a dict, methods a tuple, placed a list");
        return NULL;
    }
    PyObject *entries = PyDict_Values(watched); /* a snapshot, as iterating .values() of a dict left as it is */
    if (!entries)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries); i++) {
        PyObject *entry = PyList_GET_ITEM(entries, i);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
            PyErr_SetString(PyExc_TypeError, "place_observers(): watched maps to (role, tensor)");
            goto fail;
        }
        PyObject *role = PyTuple_GET_ITEM(entry, 0), *t = PyTuple_GET_ITEM(entry, 1);
        PyObject *d = attr_or_none(t, s_dunder_dict);
        if (!d)
            goto fail;
        if (d == Py_None) {
            Py_DECREF(d);
            continue;
        }
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(methods); k++) {
            PyObject *name = PyTuple_GET_ITEM(methods, k);
            int there = PySequence_Contains(d, name);
            if (there < 0) {
                Py_DECREF(d);
                goto fail;
            }
            if (there)
                continue;
            PyObject *method = PyObject_GetAttr(tensor_type, name);
            PyObject *observer = method ? PyObject_CallFunctionObjArgs((PyObject *)&ConversionObserverType, method, t,
                                                                        role, watch, tensor_type, NULL)
                                        : NULL;
            Py_XDECREF(method);
            int r = observer ? PyObject_SetItem(d, name, observer) : -1;
            Py_XDECREF(observer);
            PyObject *pair = r < 0 ? NULL : PyTuple_Pack(2, t, name);
            r = pair ? PyList_Append(placed, pair) : -1;
            Py_XDECREF(pair);
            if (r < 0) {
                Py_DECREF(d);
                goto fail;
            }
        }
        Py_DECREF(d);
    }
    Py_DECREF(entries);
    Py_RETURN_NONE;
fail:
    Py_DECREF(entries);
    return NULL;
}

/* remove_observers(placed): the conversion watch's exit. For each (tensor, name) of placed,
 * tensor.__dict__.pop(name, None); then placed is emptied. */
static PyObject *remove_observers(PyObject *Py_UNUSED(mod), PyObject *placed) {
    if (!PyList_Check(placed)) {
        PyErr_SetString(PyExc_TypeError, "remove_observers(): placed is a list");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(placed); i++) {
        PyObject *pair = Py_NewRef(PyList_GET_ITEM(placed, i));
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            Py_DECREF(pair);
            PyErr_SetString(PyExc_TypeError, "remove_observers(): placed holds (tensor, name)");
            return NULL;
        }
        PyObject *d = PyObject_GetAttr(PyTuple_GET_ITEM(pair, 0), s_dunder_dict);
        PyObject *r = d ? PyObject_CallMethodObjArgs(d, s_pop, PyTuple_GET_ITEM(pair, 1), Py_None, NULL) : NULL;
        Py_XDECREF(d);
        Py_DECREF(pair);
        if (!r)
            return NULL;
        Py_DECREF(r);
    }
    if (PyList_SetSlice(placed, 0, PyList_GET_SIZE(placed), NULL) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *recording(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored)) {
    return PyBool_FromLong(recording_here);
}

static PyObject *record_observer(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (takes("record_observer", nargs, 2) < 0)
        return NULL;
    return PyObject_CallFunctionObjArgs((PyObject *)&RecordObserverType, args[0], args[1], NULL);
}

static PyMethodDef module_methods[] = {
    {"runs_of", runs_of, METH_O,
     "runs_of(values, /)\n--\n\n((start, length), ...) of consecutive values, from a sequence of ints or a 1-D "
     "integer buffer."},
    {"side_runs", side_runs, METH_VARARGS,
     "side_runs(pair_runs, side, /)\n--\n\n((start, length), ...) of one side (0 host, 1 device) of pair_runs_of "
     "output, consecutive runs joined."},
    {"pair_runs_of", pair_runs_of, METH_VARARGS,
     "pair_runs_of(host, device, /)\n--\n\n((host_start, device_start, length), ...) of index pairs consecutive on "
     "both sides; as zip(), up to the shorter side."},
    {"use_refs", (PyCFunction)(void (*)(void))use_refs, METH_FASTCALL,
     "use_refs(uses, cache, ref_type, names, slow, /)\n--\n\nThe TensorRef of each tensor of uses ((pool, role) -> "
     "tensor), made once per (id, pool, role) in cache; slow(tensor, pool, role) describes what the fast reads do "
     "not."},
    {"recorded", (PyCFunction)(void (*)(void))recorded, METH_FASTCALL,
     "recorded(tensors, refs, records, stream, stream_name, stream_names, /)\n--\n\n[(place in tensors, stream "
     "name), ...]: the records (tensor, stream) made on the used tensors, or on their memory."},
    {"record_observer", (PyCFunction)(void (*)(void))record_observer, METH_FASTCALL,
     "record_observer(original, current, /)\n--\n\nWhat the SGLang adapter puts as torch.Tensor.record_stream: "
     "original's record, then (tensor, stream) appended to current.sub.records when current.sub is set and "
     "this thread is not inside a record already."},
    {"recording", recording, METH_NOARGS,
     "recording()\n--\n\nWhether this thread is inside a record a record observer is making."},
    {"meta_ref", (PyCFunction)(void (*)(void))meta_ref, METH_FASTCALL,
     "meta_ref(t, pool, role, ref_type, names, slow, /)\n--\n\nt's TensorRef without its values, as use_refs makes "
     "it (uncached); slow(t, pool, role) describes what the fast reads do not."},
    {"device_of", (PyCFunction)(void (*)(void))device_name_of, METH_FASTCALL,
     "device_of(t, names, slow, /)\n--\n\nt's device name as device_name gives it; slow(t) names what the fast "
     "reads do not."},
    {"copy_hook", (PyCFunction)(void (*)(void))copy_hook, METH_FASTCALL,
     "copy_hook(original, current, pool, first, setup=None, /)\n--\n\nWhat the SGLang adapter puts as a host pool's "
     "copy: original's call outside a submission or for index tensors the submission's copies had already (its "
     "copied), else first's (setup None), or the copy described by the hook with setup's steps."},
    {"submission_event", (PyCFunction)(void (*)(void))submission_event, METH_FASTCALL,
     "submission_event(emit, cls, sub, op_id, refs, result, now, pools, setup, /)\n--\n\nA submission's one "
     "event, emit(cls, **fields), from what the SGLang adapter's hooks noted on sub (see the module source)."},
    {"move_hook", (PyCFunction)(void (*)(void))move_hook, METH_FASTCALL,
     "move_hook(original, current, fallback, setup, /)\n--\n\nWhat the SGLang adapter puts as the controller's "
     "op-level move: the submission's op noted, and the index tensors the move put on another device kept as its "
     "moves (see the module source)."},
    {"start_hook", (PyCFunction)(void (*)(void))start_hook, METH_FASTCALL,
     "start_hook(original, current, setup, /)\n--\n\nWhat the SGLang adapter puts as the controller's "
     "start_writing / start_loading: a Submission of the queued ops as current.sub for the call's length, handed "
     "to finish after it (see the module source)."},
    {"slot_guard", (PyCFunction)(void (*)(void))slot_guard, METH_FASTCALL,
     "slot_guard(original, hook, watch, lock, /)\n--\n\nWhat the SGLang adapter puts as an allocator call that can "
     "change its free lists: with lock held, original's call inside another (watch.depth true), else hook's with "
     "watch.depth 1 for its length."},
    {"conversion_observer", (PyCFunction)(void (*)(void))conversion_observer, METH_FASTCALL,
     "conversion_observer(method, src, role, watch, tensor_type, /)\n--\n\nWhat the SGLang adapter's conversion "
     "watch puts as src.to / src.cuda: method(src, ...), described by watch.describe(src, out, role) where it gave "
     "another tensor on the watch's thread for a role not in watch.known."},
    {"place_observers", (PyCFunction)(void (*)(void))place_observers, METH_FASTCALL,
     "place_observers(watched, methods, tensor_type, watch, placed, /)\n--\n\nThe conversion watch's entry: a "
     "ConversionObserver as each method named in methods, in the __dict__ of each tensor of watched.values() (not "
     "over one there already), each (tensor, name) appended to placed."},
    {"remove_observers", remove_observers, METH_O,
     "remove_observers(placed, /)\n--\n\nThe conversion watch's exit: tensor.__dict__.pop(name, None) for each "
     "(tensor, name) of placed, then placed emptied."},
    {"slots_by_pool", (PyCFunction)(void (*)(void))slots_by_pool, METH_FASTCALL,
     "slots_by_pool(op, anchor, pool_names, pool_name, /)\n--\n\n((pool, slots), ...) an op moves: the anchor's "
     "host indices, then each transfer's pool (not those whose indices come from another pool)."},
    {"op_tensors", (PyCFunction)(void (*)(void))op_tensors, METH_FASTCALL,
     "op_tensors(host, device, transfers, anchor, tensor_type, pool_names, pool_name, /)\n--\n\n{(pool, role): "
     "tensor} of an op: the anchor's host and device indices and each transfer's, where they are tensors."},
    {"device_changes", (PyCFunction)(void (*)(void))device_changes, METH_FASTCALL,
     "device_changes(before, after, names, slow, /)\n--\n\n[((pool, role), was, now, new tensor), ...]: the "
     "tensors of before that after holds as another object on another device."},
    {"received", (PyCFunction)(void (*)(void))received, METH_FASTCALL,
     "received(uses, pool, host, device, tensor_type, /)\n--\n\nA copy's index tensors noted as uses[(pool, "
     "role)] where not there yet; {id(tensor): (role, tensor)} of those that do not report is_cuda."},
    {"value_ref", (PyCFunction)(void (*)(void))value_ref, METH_FASTCALL,
     "value_ref(t, pool, role, dev, values, ref_type, names, to_dlpack, slow, /)\n--\n\nt's TensorRef with its "
     "values (where values is true and it is on the cpu), read through one DLPack export; slow(t, pool, role, "
     "dev, values) makes what the export does not give."},
    {"read_free_lists", (PyCFunction)(void (*)(void))read_free_lists, METH_FASTCALL,
     "read_free_lists(obj, head, rest, tensor_type, /)\n--\n\n(the first list, the others, how many pages or "
     "slots they hold): one read of an allocator's free lists, kept by reference (a list of parts as (list, its "
     "length)), never by value."},
    {"dlpack_facts", dlpack_facts, METH_O,
     "dlpack_facts(capsule, /)\n--\n\n(device_type, device_id, numel, dtype_code, dtype_bits, ptr, runs) of the "
     "tensor an unconsumed \"dltensor\" capsule holds; runs (of its values, read in place) where they are host "
     "integers one stride walks, else None."},
    {NULL, NULL, 0, NULL},
};

static PyObject *get_ll(long long v) { return PyLong_FromLongLong(v); }
static PyObject *map_get_capacity(SlotMap *self, void *c) { return get_ll(self->capacity); }
static PyObject *map_get_page_size(SlotMap *self, void *c) { return get_ll(self->page_size); }
static PyObject *map_get_used(SlotMap *self, void *c) { return get_ll(self->used); }
static PyObject *map_get_free_pages(SlotMap *self, void *c) { return get_ll(self->n); }
static PyObject *map_get_available(SlotMap *self, void *c) { return get_ll(self->n * self->page_size); }

static PyGetSetDef map_getset[] = {
    {"capacity", (getter)map_get_capacity, NULL, "slots in the pool", NULL},
    {"page_size", (getter)map_get_page_size, NULL, "slots per page", NULL},
    {"used", (getter)map_get_used, NULL, "allocated slots", NULL},
    {"free_pages", (getter)map_get_free_pages, NULL, "pages on the free list", NULL},
    {"available", (getter)map_get_available, NULL, "free pages times the page size", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef map_methods[] = {
    {"apply_alloc", (PyCFunction)map_apply_alloc, METH_O,
     "Mark the slots of runs allocated; returns those that already were, or are out of range."},
    {"apply_free", (PyCFunction)map_apply_free, METH_O,
     "Mark the slots of runs free (a page whose slots are all free rejoins the back of the free list); "
     "returns those that were not allocated, or are out of range."},
    {"unallocated", (PyCFunction)map_unallocated, METH_O, "Slots among runs that are out of range or not allocated."},
    {"is_allocated", (PyCFunction)map_is_allocated, METH_O, "Whether one slot is allocated."},
    {"peek", (PyCFunction)map_peek, METH_O, "The pages the next allocation of n pages would take (FIFO order)."},
    {"free_order", (PyCFunction)map_free_order, METH_NOARGS, "Every free page, in the order they are taken."},
    {"allocated_runs", (PyCFunction)map_allocated_runs, METH_NOARGS, "The allocated slots as (start, length) runs."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SlotMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hicache_obs._slots.SlotMap",
    .tp_basicsize = sizeof(SlotMap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "SlotMap(capacity, page_size=1, track_pages=True): see hicache_obs/_slots.c.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)map_init,
    .tp_dealloc = (destructor)map_dealloc,
    .tp_methods = map_methods,
    .tp_getset = map_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slots",
                                    "Slot allocation maps, free-page lists, run-length encoding of slot indices, and the SGLang "
                                    "adapter's per-submission steps.",
                                    -1, module_methods};

PyMODINIT_FUNC PyInit__slots(void) {
    struct {
        PyTypeObject *type;
        const char *name;
    } types[] = {
        {&SlotMapType, "SlotMap"},
        {&RecordObserverType, "RecordObserver"},
        {&CopyHookType, "CopyHook"},
        {&SlotGuardType, "SlotGuard"},
        {&MoveHookType, "MoveHook"},
        {&StartHookType, "StartHook"},
        {&SubmissionType, "Submission"},
        {&OpQueueType, "OpQueue"},
        {&AckQueueType, "AckQueue"},
        {&StampType, "Stamp"},
        {&AckNoteType, "AckNote"},
        {&FinishHookType, "FinishHook"},
        {&AckTakenType, "AckTaken"},
        {&QueueClearedType, "QueueCleared"},
        {&ConversionObserverType, "ConversionObserver"},
    };
    size_t n = sizeof types / sizeof types[0];
    OpQueueType.tp_base = AckQueueType.tp_base = &PyList_Type;
    list_pop = PyObject_GetAttrString((PyObject *)&PyList_Type, "pop");
    list_remove = PyObject_GetAttrString((PyObject *)&PyList_Type, "remove");
    if (!list_pop || !list_remove)
        return NULL;
    ack_queue_mapping = *PyList_Type.tp_as_mapping;
    ack_queue_mapping.mp_ass_subscript = (objobjargproc)ack_queue_ass_subscript;
    for (size_t i = 0; i < n; i++)
        if (PyType_Ready(types[i].type) < 0)
            return NULL;
    if (adapter_strings() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        Py_INCREF(types[i].type);
        if (PyModule_AddObject(m, types[i].name, (PyObject *)types[i].type) < 0) {
            Py_DECREF(types[i].type);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
