/* Native copy loop of the cpu runtime's transfers: whole runs of slots, every layer.
 *
 * copy_runs(dst, src, runs, swap, layers, chunk,
 *           dst_slots, dst_slot_stride, dst_layer_stride,
 *           src_slots, src_slot_stride, src_layer_stride)
 *
 * dst, src: addresses of the two planes (ints, from Tensor.data_ptr()).
 * runs: a buffer of int64 triples (dst_start, src_start, length), in slots; with
 * swap set, (src_start, dst_start, length).
 * layers: how many layers each slot has; chunk: bytes of one slot of one layer.
 * *_slots: slots in each plane (every run must lie inside); strides in bytes.
 *
 * For each run and layer it copies `length` chunks; when consecutive slots are
 * adjacent in memory on both sides (layer_first planes) they move as one block.
 * With a page_first side the loop goes slot by slot (that side is walked forward
 * through memory), otherwise layer by layer. The GIL is released while it runs.
 *
 * An optional accelerator (hicache_obs/_native.py): without it (not built, or
 * HICACHE_OBS_NO_EXTENSIONS=copy) the cpu runtime copies with the torch kernels of
 * core/transfer.py, bit for bit the same (tests/native/test_differential_copy.py). It is
 * needed for data_path.page_first.ps16.write_vs_memcpy and load_vs_memcpy >= 0.7:
 * torch alone measured write 0.49 / 0.55 and load 0.51 / 0.40 (ps64: 0.54 / 0.68 and
 * 0.53 / 0.62), against 0.73 / 0.74 and 0.99 / 1.05 with this loop, two alternating runs
 * each of `hicache-obs bench --section data_path --json` on 2026-12-01, this project's
 * 2-core CPU machine (torch 2.13.0+cpu, one torch thread, load average about 5).
 *
 * Nothing moves until every argument is checked (a ValueError/TypeError naming it):
 * addresses non-null and below 2^64; layers, chunk and strides >= 1, slot counts >= 0;
 * each plane's chunks tile without overlap (see check_plane) and its last byte does not
 * wrap the address space; the two planes do not overlap; runs a C-contiguous int64
 * buffer of triples, copied before the loop (its owner may change it meanwhile), every
 * run inside both planes. What the caller vouches for: that the addresses hold planes
 * of the geometry given.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* One chunk (one slot of one layer, a few KiB). glibc's memcpy takes `rep movsb` at
 * these sizes, which runs at half speed on some CPUs (AMD Zen: 0.5 of a contiguous
 * copy for 2 KiB chunks); on x86-64 a 16-byte aligned destination is written with
 * streaming stores instead (the data goes to memory, where a transfer's target is
 * headed anyway): 1.0-1.1 of a contiguous copy on this project's machine. */
static inline void copy_chunk(char *d, const char *s, size_t n) {
#if defined(__SSE2__)
    if ((((uintptr_t)d) & 15) == 0 && (n & 63) == 0) {
        __m128i *dv = (__m128i *)d;
        const __m128i *sv = (const __m128i *)s;
        for (size_t k = 0; k < n / 16; k += 4) {
            __m128i a = _mm_loadu_si128(sv + k), b = _mm_loadu_si128(sv + k + 1);
            __m128i c = _mm_loadu_si128(sv + k + 2), e = _mm_loadu_si128(sv + k + 3);
            _mm_stream_si128(dv + k, a);
            _mm_stream_si128(dv + k + 1, b);
            _mm_stream_si128(dv + k + 2, c);
            _mm_stream_si128(dv + k + 3, e);
        }
        return;
    }
#endif
    memcpy(d, s, n);
}

/* An int argument as a long long in lo..hi, or -1 with a ValueError/TypeError that names it. */
static int get_ll(PyObject *obj, const char *name, long long lo, long long hi, long long *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "copy_runs(): %s must be an int, got %.100s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "copy_runs(): %s must be in %lld..%lld, got %R", name, lo, hi, obj);
        return -1;
    }
    *out = v;
    return 0;
}

/* One plane's geometry: its chunks must tile without overlap, either layer-major
 * (chunk <= slot stride, slots * slot stride <= layer stride) or slot-major
 * (chunk <= layer stride, layers * layer stride <= slot stride), and its last byte,
 * addr + (slots - 1) * slot stride + (layers - 1) * layer stride + chunk, must not wrap
 * the address space. *extent gets that byte count (0 for a plane of no slots). Without
 * the tiling a chunk longer than a stride writes into the next slot, past the last one
 * beyond the plane. */
static int check_plane(const char *side, unsigned long long addr, long long layers, long long chunk,
                       long long slots, long long slot, long long layer, unsigned long long *extent) {
    long long a, b;
    int layer_major = chunk <= slot && !__builtin_mul_overflow(slots, slot, &a) && a <= layer;
    int slot_major = chunk <= layer && !__builtin_mul_overflow(layers, layer, &b) && b <= slot;
    if (!layer_major && !slot_major) {
        PyErr_Format(PyExc_ValueError,
                     "copy_runs(): the %s plane's chunks overlap: chunk %lld B, %lld slots of stride %lld, "
                     "%lld layers of stride %lld (a chunk must fit its stride and the slots or layers their "
                     "outer stride)",
                     side, chunk, slots, slot, layers, layer);
        return -1;
    }
    *extent = 0;
    if (slots == 0)
        return 0;
    long long x, y, e;
    if (__builtin_mul_overflow(slots - 1, slot, &x) || __builtin_mul_overflow(layers - 1, layer, &y) ||
        __builtin_add_overflow(x, y, &e) || __builtin_add_overflow(e, chunk, &e) ||
        (unsigned long long)e > UINTPTR_MAX - addr) {
        PyErr_Format(PyExc_ValueError,
                     "copy_runs(): the %s plane at %p (%lld slots of stride %lld, %lld layers of stride %lld) "
                     "runs past the end of the address space",
                     side, (void *)(uintptr_t)addr, slots, slot, layers, layer);
        return -1;
    }
    *extent = (unsigned long long)e;
    return 0;
}

static int get_addr(PyObject *obj, const char *name, unsigned long long *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "copy_runs(): %s must be an address (int), got %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow > 0) { /* above 2^63: the upper half of a 64-bit address space, if it fits */
        unsigned long long u = PyLong_AsUnsignedLongLong(obj);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
        } else if (u <= UINTPTR_MAX) {
            *out = u;
            return 0;
        }
    } else if (!overflow && v > 0 && (unsigned long long)v <= UINTPTR_MAX) {
        *out = (unsigned long long)v;
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "copy_runs(): %s must be a non-null address, got %R", name, obj);
    return -1;
}

/* The runs as int64 (signed, 8-byte items: what array('q') and an int64 tensor's numpy view give). */
static int runs_format_ok(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    return v->itemsize == 8 && f[0] && !f[1] && (f[0] == 'q' || (f[0] == 'l' && sizeof(long) == 8));
}

static PyObject *copy_runs(PyObject *self, PyObject *args) {
    PyObject *o[12];
    if (!PyArg_UnpackTuple(args, "copy_runs", 12, 12, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7],
                           &o[8], &o[9], &o[10], &o[11]))
        return NULL;
    unsigned long long dst_addr, src_addr;
    long long layers, chunk, dst_slots, dst_slot, dst_layer, src_slots, src_slot, src_layer;
    const long long MAX = LLONG_MAX;
    int swap = PyObject_IsTrue(o[3]);
    if (swap < 0 || get_addr(o[0], "dst", &dst_addr) < 0 || get_addr(o[1], "src", &src_addr) < 0 ||
        get_ll(o[4], "layers", 1, MAX, &layers) < 0 || get_ll(o[5], "chunk", 1, MAX, &chunk) < 0 ||
        get_ll(o[6], "dst_slots", 0, MAX, &dst_slots) < 0 || get_ll(o[7], "dst_slot_stride", 1, MAX, &dst_slot) < 0 ||
        get_ll(o[8], "dst_layer_stride", 1, MAX, &dst_layer) < 0 ||
        get_ll(o[9], "src_slots", 0, MAX, &src_slots) < 0 || get_ll(o[10], "src_slot_stride", 1, MAX, &src_slot) < 0 ||
        get_ll(o[11], "src_layer_stride", 1, MAX, &src_layer) < 0) {
        if (PyErr_ExceptionMatches(PyExc_ValueError) && PyLong_Check(o[4]) && PyLong_Check(o[5])) {
            /* the message the callers know, with the values */
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            PyErr_Format(PyExc_ValueError, "bad geometry: layers %R, chunk %R, strides %R/%R and %R/%R: %S", o[4],
                         o[5], o[7], o[8], o[10], o[11], v ? v : Py_None);
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
        }
        return NULL;
    }
    unsigned long long dst_ext, src_ext;
    if (check_plane("dst", dst_addr, layers, chunk, dst_slots, dst_slot, dst_layer, &dst_ext) < 0 ||
        check_plane("src", src_addr, layers, chunk, src_slots, src_slot, src_layer, &src_ext) < 0)
        return NULL;
    if (dst_ext && src_ext && dst_addr < src_addr + src_ext && src_addr < dst_addr + dst_ext) {
        PyErr_Format(PyExc_ValueError, "copy_runs(): the planes overlap (dst %p + %llu B, src %p + %llu B)",
                     (void *)(uintptr_t)dst_addr, dst_ext, (void *)(uintptr_t)src_addr, src_ext);
        return NULL;
    }
    Py_buffer runs;
    if (PyObject_GetBuffer(o[2], &runs, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (!runs_format_ok(&runs)) {
        PyErr_Format(PyExc_TypeError, "copy_runs(): runs must be a buffer of int64 (format 'q'), got format '%s' of %zd-byte items",
                     runs.format ? runs.format : "B", runs.itemsize);
        PyBuffer_Release(&runs);
        return NULL;
    }
    if (runs.len % (3 * (Py_ssize_t)sizeof(int64_t)) != 0) {
        PyBuffer_Release(&runs);
        return PyErr_Format(PyExc_ValueError, "runs must be int64 triples, got %zd bytes", runs.len);
    }
    /* a private copy: the buffer's owner may change it while the loop runs without the GIL */
    Py_ssize_t n_runs = runs.len / (3 * (Py_ssize_t)sizeof(int64_t));
    int64_t *r = PyMem_Malloc(runs.len ? (size_t)runs.len : 1);
    if (!r) {
        PyBuffer_Release(&runs);
        return PyErr_NoMemory();
    }
    memcpy(r, runs.buf, (size_t)runs.len);
    PyBuffer_Release(&runs);
    const int di = swap ? 1 : 0, si = swap ? 0 : 1;
    for (Py_ssize_t i = 0; i < n_runs; i++) {
        int64_t d = r[3 * i + di], s = r[3 * i + si], n = r[3 * i + 2];
        if (d < 0 || s < 0 || n <= 0 || d > dst_slots - n || s > src_slots - n) {
            PyMem_Free(r);
            return PyErr_Format(PyExc_ValueError,
                                "run %zd (dst %lld, src %lld, length %lld) is outside the planes (%lld and %lld slots)",
                                i, (long long)d, (long long)s, (long long)n, dst_slots, src_slots);
        }
    }
    char *dst = (char *)(uintptr_t)dst_addr;
    const char *src = (const char *)(uintptr_t)src_addr;
    const int contiguous = dst_slot == chunk && src_slot == chunk;
    /* a page_first side (the layers of a slot adjacent) is walked forward, slot by slot */
    const int slot_major = dst_slot > dst_layer || src_slot > src_layer;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n_runs; i++) {
        int64_t d = r[3 * i + di], s = r[3 * i + si], n = r[3 * i + 2];
        if (contiguous) {
            for (long long l = 0; l < layers; l++)
                copy_chunk(dst + d * dst_slot + l * dst_layer, src + s * src_slot + l * src_layer, (size_t)(n * chunk));
        } else if (slot_major) {
            for (int64_t t = 0; t < n; t++) {
                char *dp = dst + (d + t) * dst_slot;
                const char *sp = src + (s + t) * src_slot;
                for (long long l = 0; l < layers; l++)
                    copy_chunk(dp + l * dst_layer, sp + l * src_layer, (size_t)chunk);
            }
        } else {
            for (long long l = 0; l < layers; l++) {
                char *dp = dst + d * dst_slot + l * dst_layer;
                const char *sp = src + s * src_slot + l * src_layer;
                for (int64_t t = 0; t < n; t++)
                    copy_chunk(dp + t * dst_slot, sp + t * src_slot, (size_t)chunk);
            }
        }
    }
#if defined(__SSE2__)
    _mm_sfence(); /* streaming stores are visible to other threads once this returns */
#endif
    Py_END_ALLOW_THREADS;
    PyMem_Free(r);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS, "Copy runs of slots between two planes, every layer (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy", "The cpu runtime's native copy loop.", -1, methods};

PyMODINIT_FUNC PyInit__copy(void) { return PyModule_Create(&module); }
